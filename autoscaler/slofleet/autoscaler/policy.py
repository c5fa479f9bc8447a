"""The SLO-driven scaling policy: pure, one instance per role (unified, prefill or decode).

desired = clamp(max(proactive, reactive)), then: up at once, down only after the stabilization window, a
step at a time, and only when the remaining replicas can take the in-flight work (drain before removal).

- proactive: each bucket's load (its arrival rate times the work of its requests, priced by the replica profile
  at the strictest TPOT target) is forecast to when a replica asked for now would serve (forecast.py: level,
  trend, yesterday's curvature) and raised by headroom: the quantile of the forecast's own recent errors that
  the bucket needs. That quantile is learnt per bucket from the attainment the policy reads: misses beyond the
  share `aim` of the budget its percentile allows raise it, attainment above lowers it, so the fleet buys what
  each bucket's percentile asks and no more; the count is the cheapest that covers every bucket;
- reactive: saturation (queue, KV, preemptions) adds replicas at once; a bucket under its percentile holds the
  fleet from scaling down; neither adds while earlier replicas are still starting (they are the cold-start
  allowance, not a reason to add more).
The policy reads only the metrics windows a cluster gives it, never what is to come.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from slofleet.api.contract import DECODE, DEFAULT_BUCKET, PREFILL, ROLES, UNIFIED
from slofleet.api.v1alpha1 import SIGNALS

from .forecast import Forecaster
from .profiles import Profile
from .signals import BucketWindow, RoleSignals, Window, stale, window


@dataclass
class SLO:
    ttft_s: float = 0.5
    tpot_s: float = 0.05
    target: float = 0.95  # share of requests that must meet both
    e2e_s: float = math.inf  # whole request (the simulator judges it; engines' TTFT and TPOT drive the policy)


@dataclass
class PolicyConfig:
    role: str = UNIFIED
    slo: SLO = field(default_factory=SLO)
    min_replicas: int = 1
    max_replicas: int = 64
    prefill_tps: float = 20_000.0  # prior: prompt tokens/s one replica computes when only prefilling
    decode_tps: float = 4_000.0  # prior: tokens/s one replica generates at the TPOT target
    profile: Profile | None = None  # prices each bucket's mix (else the two priors above, the same for any mix)
    buckets: dict[str, SLO] = field(default_factory=dict)  # each bucket's targets and percentile; others: `slo`
    utilization: float = 1.0  # the share of (learnt) capacity planned for; the capacity is at the TPOT target
    aim: float = 0.75  # spend this share of each bucket's miss budget (1 - percentile), not more, not much less
    adapt_s: float = 7200.0  # the headroom quantile's logit moves by (aim - budget spent) per this many seconds
    cold_start_s: float = 90.0
    trend_s: float = 1800.0  # the forecast's trend is fitted over this span
    level_s: float = 60.0  # and its level is the mean of the windows of this span
    down_window_s: float = 300.0  # scale down only to the highest recommendation seen in this window
    up_window_s: float = 0.0  # scale up only to the lowest recommendation seen in this window (0: at once)
    down_step: float = 0.1  # at most this share of replicas (at least one) removed per decision
    stale_after_s: float = 60.0
    waiting_per_replica: float = 5.0  # saturation: queue per replica
    kv_high: float = 0.9  # saturation: KV usage
    grace_s: float = 60.0  # drain: in-flight requests must finish within the pod's grace period
    signals: frozenset[str] = frozenset(SIGNALS)  # what may add replicas beside the forecast (spec.autoscaling)

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
        self.forecasts: dict[str, Forecaster] = {}  # per bucket: its load, in replicas at the prior capacity
        self.quantile: dict[str, float] = {}  # per bucket: the logit of the forecast-error quantile it needs
        self.requests: dict[str, float] = {}  # per bucket: running mean of its requests per window
        self.t: float | None = None  # the previous decision's time
        self.full_since: float | None = None  # saturated in every decision since
        self.prev: RoleSignals | None = None  # the newest scrape the previous decision read
        self.recs: deque[tuple[float, int]] = deque()  # (time, recommendation) for scale-down stabilization

    def decide(self, now: float, win: Window | None, fleet: Fleet) -> Decision:
        cfg = self.cfg
        if win is None or stale(win.now, now, cfg.stale_after_s):
            keep = self.last.desired if self.last else fleet.total
            age = "no scrape" if win is None else f"newest scrape {now - win.now.t:.0f}s old"
            self.last = Decision(keep, f"holding {keep}: metrics missing or stale ({age})", "MetricsStale")
            return self.last
        if not self.recs and cfg.down_window_s:  # just started: what runs (or is on record) was recommended before
            self.recs.append((now, self.last.desired if self.last else fleet.total))
        self.learn(now, win, fleet)
        proactive, why_pro = self.proactive(now, win)
        reactive, why_re = self.reactive(win, fleet)
        rec, why = (reactive, why_re) if reactive > proactive else (proactive, why_pro)
        rec = min(max(rec, cfg.min_replicas), cfg.max_replicas)
        self.recs.append((now, rec))
        while self.recs[0][0] < now - max(cfg.down_window_s, cfg.up_window_s):
            self.recs.popleft()
        self.last = self.settle(now, rec, why, win, fleet)
        return self.last

    # -- what the window says, per bucket ------------------------------------------------------------
    def buckets(self, win: Window) -> dict[str, BucketWindow]:
        """The window's buckets; a window without them (an engine without bucket labels) is one bucket."""
        if win.buckets:
            return win.buckets
        n = win.arrival_rate * win.seconds
        return {DEFAULT_BUCKET: BucketWindow(n, win.arrival_rate, win.mean_prompt or 0.0, win.mean_output or 0.0,
                                        win.ttft_attainment, win.itl_attainment)} if win.mean_prompt else {}

    def target(self, bucket: str) -> SLO:
        return self.cfg.buckets.get(bucket, self.cfg.slo)

    def attained(self, b: BucketWindow) -> float | None:
        """The share of this role's latency a bucket met: prefill reads TTFT, decode TPOT and E2E (a decode engine
        answers the whole request), unified all three."""
        clocks = ((b.ttft_attainment, PREFILL), (b.itl_attainment, DECODE), (b.e2e_attainment, DECODE))
        seen = [x for x, role in clocks if x is not None and self.cfg.role in (role, UNIFIED)]
        return min(seen) if seen else None

    def rates(self, prompt: float, output: float) -> tuple[float, float]:
        """Prompt and generated tokens/s one replica takes at the strictest TPOT target, for this mix."""
        if self.cfg.profile is None:
            return self.cfg.prefill_tps, self.cfg.decode_tps
        tpot = min([t.tpot_s for t in self.cfg.buckets.values()] + [self.cfg.slo.tpot_s])
        return self.cfg.profile.rates(prompt, output, tpot)

    def demand(self, rate: float, prompt: float, output: float) -> float:
        """Replicas needed at full prior capacity for `rate` requests/s of this mix."""
        pre, dec = self.rates(prompt, output)
        return {PREFILL: rate * prompt / pre, DECODE: rate * output / dec}.get(self.cfg.role,
                                                                                rate * (prompt / pre + output / dec))

    # -- the two recommendations ------------------------------------------------------------
    def proactive(self, now: float, win: Window) -> tuple[int, str]:
        cfg = self.cfg
        # the forecast is fed what arrived since the previous decision's scrape (the window's newest part, so a
        # rise shows sooner); the whole window when that part saw no request
        fresh = window(self.prev, win.now, {}) if self.prev is not None and win.now.t > self.prev.t else None
        if fresh is None or not fresh.buckets:
            fresh = win
        self.prev = win.now
        mid, seen = fresh.now.t - fresh.seconds / 2, self.buckets(fresh)
        for name in set(self.forecasts) - set(seen) if seen else ():
            self.forecasts[name].add(mid, 0.0)  # a bucket without requests in a window has no load
        for name, b in seen.items():
            self.forecasts.setdefault(name, Forecaster(cfg.trend_s, cfg.level_s)).add(
                mid, self.demand(b.arrival_rate, b.mean_prompt, b.mean_output), b.requests)
        when = now + cfg.cold_start_s
        load = {n: f.predict(when) for n, f in self.forecasts.items()}
        room = {n: f.headroom(self.level(n)) for n, f in self.forecasts.items()}
        need = sum(load[n] * room[n] for n in load) / self.scale / cfg.utilization
        head = ", ".join(f"{n} +{room[n] - 1:.0%} (p{self.level(n):.0%} of its errors)" for n in load)
        return math.ceil(need - 1e-9), (f"{win.arrival_rate:.1f} req/s now; forecast load {sum(load.values()):.1f} "
                                        f"replicas in {cfg.cold_start_s:.0f}s, headroom {head or '-'}: "
                                        f"{need:.1f} replicas")

    def level(self, bucket: str) -> float:
        """The quantile of forecast errors a bucket's headroom covers: from the median (no headroom until misses
        show that some is needed) up to 0.999."""
        return 1 / (1 + math.exp(-self.quantile.get(bucket, 0.0)))

    def pressure(self, win: Window) -> tuple[list[str], list[str]]:
        """This role's missed percentiles and its saturation, of the signals it is given (slo, queue, kvCache):
        prefill reads TTFT and its queue, decode reads TPOT (inter-token latency), E2E, KV usage and preemptions;
        unified reads all."""
        cfg, s = self.cfg, win.now
        pods, miss, full, on = max(s.pods, 1), [], [], cfg.signals
        for name, b in self.buckets(win).items() if "slo" in on else ():
            got, want = self.attained(b), self.target(name).target
            if got is not None and got < want:
                miss.append(f"{name} attainment {got:.1%} < {want:.0%}")
        if cfg.role != DECODE and "queue" in on and s.waiting / pods > cfg.waiting_per_replica:
            full.append(f"{s.waiting / pods:.1f} waiting per replica")
        if cfg.role != PREFILL and "kvCache" in on:
            if s.kv_usage > cfg.kv_high:
                full.append(f"KV usage {s.kv_usage:.0%}")
            if win.preemption_rate > 0:
                full.append(f"{win.preemption_rate:.2f} preemptions/s")
        return miss, full

    def reactive(self, win: Window, fleet: Fleet) -> tuple[int, str]:
        cfg, s = self.cfg, win.now
        miss, full = self.pressure(win)
        if not miss and not full:
            return 0, "SLOs met"
        why = ", ".join(full + miss)
        if fleet.starting:  # the cold-start allowance: replicas on their way are the response
            return fleet.total, f"{why}; {fleet.starting} replicas still starting"
        if not full:  # a missed percentile alone lowers the learnt share; meanwhile nothing is removed
            return fleet.total, why
        # enough to clear the queued prompt tokens within one cold start on top of the current load
        pre = self.rates(win.mean_prompt or 1.0, win.mean_output or 1.0)[0]
        backlog = s.queued_prompt_tokens / (pre * self.scale * cfg.cold_start_s)
        add = max(1, math.ceil(0.2 * fleet.total), math.ceil(backlog))
        return fleet.total + add, f"{why}: +{add}"

    # -- learning and stabilization ---------------------------------------------------------
    def learn(self, now: float, win: Window, fleet: Fleet) -> None:
        """Each bucket's headroom quantile, from its attainment against the budget its percentile allows; and
        the capacity prior: when the fleet stays saturated, what it sustains is its capacity; when it meets every
        percentile above the modelled capacity, the model is too pessimistic."""
        cfg = self.cfg
        dt, self.t = (min(now - self.t, 60.0) if self.t is not None else 0.0), now
        seen = self.buckets(win)
        if fleet.total < cfg.max_replicas:  # a capped fleet's misses say nothing about its headroom
            for name, b in seen.items():
                got, want = self.attained(b), self.target(name).target
                if got is not None:
                    # weighed by the window's requests against their running mean: attainment is per request
                    typical = self.requests.get(name, b.requests)
                    self.requests[name] = typical + (b.requests - typical) * min(dt / cfg.adapt_s, 1.0)
                    spent = (1 - got) / max(1 - want, 1e-3)
                    q, weight = self.level(name), b.requests / max(typical, 1e-9)
                    z = math.log(q / (1 - q)) + (spent - cfg.aim) * weight * dt / cfg.adapt_s
                    self.quantile[name] = min(max(z, 0.0), 7.0)  # quantiles 0.5 .. 0.999
        if fleet.ready == 0 or win.mean_prompt is None or win.mean_output is None:
            return
        pre, dec = self.rates(win.mean_prompt, win.mean_output)
        load = {PREFILL: win.prompt_rate / pre, DECODE: win.output_rate / dec}.get(
            cfg.role, win.prompt_rate / pre + win.output_rate / dec) / fleet.ready
        miss, full = self.pressure(win)
        self.full_since = (self.full_since or now) if full else None
        sustained = self.full_since is not None and now - self.full_since >= win.seconds  # not one burst
        if (sustained and load < self.scale) or (not miss and not full and load > self.scale):
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
