"""The SLO-driven scaling policy: pure, one instance per role (unified, prefill or decode).

desired = clamp(max(proactive, reactive)), then: up at once, down only after the stabilization window, a
step at a time, and only when the remaining replicas can take the in-flight work (drain before removal).

- proactive: arrival rate forecast `cold_start_s` ahead (a replica asked for now serves only then) times
  the work per request (mean prompt / output tokens), over a per-replica capacity whose prior comes from
  the replica profile and is corrected by what the fleet is seen to sustain;
- reactive: SLO attainment below target or saturation (queue, KV, preemptions) adds replicas, but not
  while earlier ones are still starting (they are the cold-start allowance, not a reason to add more).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from slofleet.api.contract import DECODE, PREFILL, ROLES, UNIFIED

from .signals import Window, stale


@dataclass
class SLO:
    ttft_s: float = 0.5
    tpot_s: float = 0.05
    target: float = 0.95  # share of requests that must meet both


@dataclass
class PolicyConfig:
    role: str = UNIFIED
    slo: SLO = field(default_factory=SLO)
    min_replicas: int = 1
    max_replicas: int = 64
    prefill_tps: float = 20_000.0  # prior: prompt tokens/s one replica computes when only prefilling
    decode_tps: float = 4_000.0  # prior: tokens/s one replica generates at the TPOT target
    utilization: float = 0.9  # the proactive part plans for this share of capacity (the reactive part backs it)
    cold_start_s: float = 90.0
    trend_s: float = 300.0  # arrival-rate history used for the forecast
    down_window_s: float = 300.0  # scale down only to the highest recommendation seen in this window
    up_window_s: float = 0.0  # scale up only to the lowest recommendation seen in this window (0: at once)
    down_step: float = 0.1  # at most this share of replicas (at least one) removed per decision
    stale_after_s: float = 60.0
    waiting_per_replica: float = 5.0  # saturation: queue per replica
    kv_high: float = 0.9  # saturation: KV usage
    grace_s: float = 60.0  # drain: in-flight requests must finish within the pod's grace period

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas")


@dataclass
class Fleet:
    ready: int  # replicas serving
    starting: int = 0  # asked for, not ready yet

    @property
    def total(self) -> int:
        return self.ready + self.starting


@dataclass
class Decision:
    desired: int
    reason: str
    condition: str = "Ok"  # Ok | MetricsStale | Stabilizing | Draining | ScalingLimited


class Policy:
    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg
        self.last: Decision | None = None
        self.scale = 1.0  # learnt capacity / prior capacity
        self.rates: deque[tuple[float, float]] = deque()  # (time, arrival rate)
        self.recs: deque[tuple[float, int]] = deque()  # (time, recommendation) for scale-down stabilization

    def decide(self, now: float, win: Window | None, fleet: Fleet) -> Decision:
        cfg = self.cfg
        if win is None or stale(win.now, now, cfg.stale_after_s):
            keep = self.last.desired if self.last else fleet.total
            age = "no scrape" if win is None else f"newest scrape {now - win.now.t:.0f}s old"
            self.last = Decision(keep, f"holding {keep}: metrics missing or stale ({age})", "MetricsStale")
            return self.last
        self.learn(win, fleet)
        proactive, why_pro = self.proactive(now, win)
        reactive, why_re = self.reactive(win, fleet)
        rec, why = (reactive, why_re) if reactive > proactive else (proactive, why_pro)
        rec = min(max(rec, cfg.min_replicas), cfg.max_replicas)
        self.recs.append((now, rec))
        while self.recs[0][0] < now - max(cfg.down_window_s, cfg.up_window_s):
            self.recs.popleft()
        self.last = self.settle(now, rec, why, win, fleet)
        return self.last

    # -- the two recommendations ------------------------------------------------------------
    def demand(self, rate: float, win: Window) -> float:
        """Replicas needed at full capacity for `rate` requests/s of this window's mix."""
        p = win.mean_prompt if win.mean_prompt is not None else 0.0
        o = win.mean_output if win.mean_output is not None else 0.0
        pre, dec = rate * p / (self.cfg.prefill_tps * self.scale), rate * o / (self.cfg.decode_tps * self.scale)
        return {PREFILL: pre, DECODE: dec}.get(self.cfg.role, pre + dec)

    def proactive(self, now: float, win: Window) -> tuple[int, str]:
        self.rates.append((now, win.arrival_rate))
        while self.rates[0][0] < now - self.cfg.trend_s:
            self.rates.popleft()
        rate = forecast(list(self.rates), now + self.cfg.cold_start_s)
        need = self.demand(rate, win) / self.cfg.utilization
        return math.ceil(need - 1e-9), (f"forecast {rate:.1f} req/s in {self.cfg.cold_start_s:.0f}s needs "
                                        f"{need:.1f} replicas at {self.cfg.utilization:.0%} of learnt capacity")

    def pressure(self, win: Window) -> list[str]:
        """This role's missed SLOs and saturation: prefill reads TTFT and its queue, decode reads TPOT
        (inter-token latency), KV usage and preemptions; unified reads all."""
        cfg, s = self.cfg, win.now
        pods, miss = max(s.pods, 1), []
        if cfg.role != DECODE:
            if win.ttft_attainment is not None and win.ttft_attainment < cfg.slo.target:
                miss.append(f"TTFT attainment {win.ttft_attainment:.1%}")
            if s.waiting / pods > cfg.waiting_per_replica:
                miss.append(f"{s.waiting / pods:.1f} waiting per replica")
        if cfg.role != PREFILL:
            if win.itl_attainment is not None and win.itl_attainment < cfg.slo.target:
                miss.append(f"TPOT attainment {win.itl_attainment:.1%}")
            if s.kv_usage > cfg.kv_high:
                miss.append(f"KV usage {s.kv_usage:.0%}")
            if win.preemption_rate > 0:
                miss.append(f"{win.preemption_rate:.2f} preemptions/s")
        return miss

    def reactive(self, win: Window, fleet: Fleet) -> tuple[int, str]:
        cfg, s = self.cfg, win.now
        miss = self.pressure(win)
        if not miss:
            return 0, "SLOs met"
        if fleet.starting:  # the cold-start allowance: replicas on their way are the response
            return fleet.total, f"{', '.join(miss)}; {fleet.starting} replicas still starting"
        # enough to clear the queued prompt tokens within one cold start on top of the current load
        backlog = s.queued_prompt_tokens / (cfg.prefill_tps * self.scale * cfg.cold_start_s)
        add = max(1, math.ceil(0.2 * fleet.total), math.ceil(backlog))
        return fleet.total + add, f"{', '.join(miss)}: +{add}"

    # -- learning and stabilization ---------------------------------------------------------
    def learn(self, win: Window, fleet: Fleet) -> None:
        """Correct the capacity prior: when the fleet is saturated, what it sustains is its capacity; when it
        meets its SLOs above the modelled capacity, the model is too pessimistic."""
        if fleet.ready == 0 or win.mean_prompt is None or win.mean_output is None:
            return
        load = (win.prompt_rate / self.cfg.prefill_tps + win.output_rate / self.cfg.decode_tps) / fleet.ready
        if self.cfg.role == PREFILL:
            load = win.prompt_rate / self.cfg.prefill_tps / fleet.ready
        elif self.cfg.role == DECODE:
            load = win.output_rate / self.cfg.decode_tps / fleet.ready
        hot = bool(self.pressure(win))
        if (hot and load < self.scale) or (not hot and load > self.scale):
            self.scale = min(max(0.8 * self.scale + 0.2 * load, 0.25), 4.0)

    def settle(self, now: float, rec: int, why: str, win: Window, fleet: Fleet) -> Decision:
        cfg, cur = self.cfg, fleet.total
        if rec > cur and cfg.up_window_s > 0:
            floor = min(r for t, r in self.recs if t >= now - cfg.up_window_s)
            if floor <= cur:
                return Decision(cur, f"hold {cur}: {why}, but {floor} was recommended within "
                                     f"{cfg.up_window_s:.0f}s", "Stabilizing")
            rec = floor
        limited = rec in (cfg.min_replicas, cfg.max_replicas) and rec != cur
        cond = "ScalingLimited" if limited else "Ok"
        if rec >= cur:
            verb = "scale up" if rec > cur else "hold"
            return Decision(rec, f"{verb} to {rec}: {why}", cond)
        ceiling = max(r for t, r in self.recs if t >= now - cfg.down_window_s)
        if ceiling >= cur:
            return Decision(cur, f"hold {cur}: {why}, but {ceiling} was recommended within "
                                 f"{cfg.down_window_s:.0f}s", "Stabilizing")
        target = max(ceiling, cur - max(1, int(cur * cfg.down_step)))
        ok, wait = drainable(win, fleet, target, cfg)
        if not ok:
            return Decision(cur, f"hold {cur}: would scale down to {target} but {wait}", "Draining")
        return Decision(target, f"scale down to {target}: {why}; in-flight work fits on {target}", cond)


def forecast(samples: list[tuple[float, float]], at: float) -> float:
    """Least-squares line through recent arrival rates: its level now, plus its rise until `at` when it is
    rising (a falling trend is left to the slow scale-down, not anticipated); or the mean of the last two
    samples when higher, so a sustained step counts within two decisions while one noisy window does not."""
    now, newest = samples[-1]
    if len(samples) < 3:
        return newest
    ts = [t for t, _ in samples]
    rs = [r for _, r in samples]
    tm, rm = sum(ts) / len(ts), sum(rs) / len(rs)
    var = sum((t - tm) ** 2 for t in ts)
    slope = sum((t - tm) * (r - rm) for t, r in zip(ts, rs)) / var if var else 0.0
    return max(rm + slope * (now - tm) + max(slope, 0.0) * (at - now), (rs[-1] + rs[-2]) / 2, 0.0)


def drainable(win: Window, fleet: Fleet, target: int, cfg: PolicyConfig) -> tuple[bool, str]:
    """Can `target` replicas take the in-flight work of the ones removed, within the grace period?"""
    s = win.now
    if target <= 0:
        return s.running + s.waiting == 0, f"{s.running + s.waiting:.0f} requests in flight"
    if fleet.ready and s.kv_usage * fleet.ready / target > cfg.kv_high:
        return False, f"KV usage would reach {s.kv_usage * fleet.ready / target:.0%} on {target} replicas"
    if s.waiting / target > cfg.waiting_per_replica:
        return False, f"{s.waiting:.0f} requests still waiting"
    tail = (win.mean_output or 0.0) * cfg.slo.tpot_s  # a typical in-flight request's remaining decode
    if tail > cfg.grace_s:
        return False, f"in-flight requests need ~{tail:.0f}s, more than the {cfg.grace_s:.0f}s grace period"
    return True, ""
