"""Fleet simulator: a trace through a fleet of unified replicas under one scaling controller.

Time advances in ticks of `dt` seconds; within a tick the fleet is a fluid queueing model behind a
load-balancing router:
- prefill: one FIFO of prompt tokens, served by the ready replicas at the profile's chunked-prefill rate,
  limited by free KV and batch slots; a request's first token comes when the served tokens pass its place in
  the queue, and never sooner than its own prompt alone would take;
- decode: all running requests advance one token per step; a step costs step + decode_seq * batch +
  kv_token * KV tokens per replica, in the time prefill leaves; a request finishes `output - 1` steps after
  its first token (a ring of finish steps, so batch and KV shrink as requests end);
- KV: admission waits for free KV; overflow preempts (recompute tokens are served before the queue);
- replicas: asked-for ones start after the profile's cold start; removed ones stop taking prompts at once
  and are paid until their in-flight requests drain; metrics are scraped every `scrape_s` and the controller
  sees them `scrape_delay_s` late; like an engine's, the latency histograms and token counters are per bucket
  (the trace's `bucket` of each request; the queue itself is one FIFO, as the fleet has no bucket priorities).
Per-request TTFT and TPOT are read afterwards from the recorded served-prompt-tokens and step-count curves.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from slofleet.api.contract import UNIFIED

from .policy import SLO, Decision, Fleet
from .profiles import Profile
from .signals import Histogram, RoleSignals, Window, window
from .traces import Trace


class Controller(Protocol):
    def decide(self, now: float, win: Window | None, fleet: Fleet) -> Decision: ...


@dataclass
class SimConfig:
    profile: Profile
    slo: SLO = field(default_factory=SLO)
    initial: int = 1
    dt: float = 0.5
    scrape_s: float = 10.0
    scrape_delay_s: float = 5.0  # collection lag before a scrape reaches the controller
    decide_s: float = 15.0
    window_s: float = 60.0  # rates and attainment are read over this window
    tail_s: float = 300.0  # keep running after the last arrival so in-flight requests can finish
    buckets: dict[str, SLO] = field(default_factory=dict)  # targets by bucket (trace.bucket indexes them in order);
    # none: every request is in bucket 'default' with `slo`

    def targets(self) -> dict[str, SLO]:
        return self.buckets or {"default": self.slo}


@dataclass
class Result:
    policy: str
    trace: str
    attainment: float  # share of requests meeting both TTFT and TPOT (unfinished = missed)
    replica_hours: float
    actions: int  # changes of the desired replica count
    ttft_p50: float
    tpot_p50: float
    preemptions: int
    t: np.ndarray  # minute marks
    replicas: np.ndarray  # paid replicas (starting + ready + draining) per minute
    attained: np.ndarray  # attainment of the requests arriving in each minute (nan: none)
    good: int  # requests that met both targets
    reasons: list[str] = field(default_factory=list)  # every change of the desired count, with its reason
    buckets: dict[str, float] = field(default_factory=dict)  # attainment by bucket (its own targets)

    @property
    def goodput_per_rh(self) -> float:
        return self.good / max(self.replica_hours, 1e-9)


def simulate(trace: Trace, ctrl: Controller, cfg: SimConfig, name: str = "") -> Result:
    prof, dt, targets = cfg.profile, cfg.dt, cfg.targets()
    arr, p, o = trace.arrival, trace.prompt.astype(np.float64), trace.output.astype(np.int64)
    cls, nb = trace.classes(), len(targets)
    ttft_t, tpot_t = (np.array([getattr(x, a) for x in targets.values()]) for a in ("ttft_s", "tpot_s"))
    pos = np.cumsum(p)  # each request's last prompt token's place in the fleet's prefill queue
    ticks = int(math.ceil((trace.duration + cfg.tail_s) / dt))
    alone = np.ceil(p / prof.token_budget) * prof.step_s + p * prof.prefill_token_s  # its prefill on an idle replica
    first = np.full(len(p), np.inf)  # first-token time per request
    last_step = np.full(len(p), np.inf)  # the step count S at which its last token comes
    steps = np.zeros(ticks + 1)  # decode steps done per replica (S) at each tick boundary
    ring_len = int(o.max()) + int(dt / prof.step_s) + 2  # a finish step is at most one tick's steps + output ahead
    # per finish slot: requests, their prompt tokens, their entry step; running KV is then exact:
    # K = prompts + B * S - entry steps (each running request holds its prompt plus one token per step)
    ring_n, ring_p, ring_s0 = np.zeros((ring_len, nb)), np.zeros(ring_len), np.zeros(ring_len)  # ring_n by bucket
    C = debt = S = K = kv_p = kv_s0 = evicted = 0.0
    B, done_pre, arrived, running = 0, 0, 0, np.zeros(nb)  # running: B by bucket
    ready, starting, draining = cfg.initial, deque(), deque()  # starting/draining: times they change state
    cum = dict(prompt=0.0, gen=0.0, fin=0.0, preempt=0.0)
    by = {k: np.zeros(nb) for k in ("prompt", "gen", "ttft_ok", "ttft_n", "itl_ok", "itl_n")}  # counters by bucket
    snaps: list[RoleSignals] = []
    paid_s, actions, desired, reasons = 0.0, 0, cfg.initial, []
    minute_paid = np.zeros(ticks // int(60 / dt) + 2)
    a, bp, cs, dk = prof.step_s, prof.prefill_token_s, prof.decode_seq_s, prof.kv_token_s
    step_time = a
    for k in range(ticks):
        t0, t1 = k * dt, (k + 1) * dt
        while starting and starting[0] <= t0:
            starting.popleft()
            ready += 1
        while draining and draining[0] <= t0:
            draining.popleft()
        serving = ready + len(draining)
        arrived = int(np.searchsorted(arr, t1))
        queued = (pos[arrived - 1] if arrived else 0.0) - C
        # -- prefill, sharing each step's token budget with the running decodes
        pre_time, C0, new = 0.0, C, done_pre
        if ready and queued + debt > 0 and B < prof.max_batch * serving:
            b = B / serving
            chunk = max(prof.token_budget - b, 1.0)
            tau = a + cs * b + dk * K / serving
            speed = ready * chunk / (tau + bp * chunk)  # prompt tokens/s while the queue lasts
            x = min(queued + debt, speed * dt, max(prof.kv_tokens * serving - K, 0.0))
            from_debt = min(debt, x)
            debt -= from_debt
            evicted = max(evicted - from_debt, 0.0)
            C += x - from_debt
            pre_time = x / ready * bp
            new = int(np.searchsorted(pos, C + 1e-6, side="right"))
        if new > done_pre:
            sl = slice(done_pre, new)
            oo, pp, cc = o[sl], p[sl], cls[sl]
            # at full speed from the tick's start, after the recompute debt; never before its own prefill
            first[sl] = np.maximum(t0 + (from_debt + pos[sl] - C0) / speed, arr[sl] + alone[sl])
            entering = np.bincount(cc, minlength=nb)
            by["ttft_n"] += entering
            by["ttft_ok"] += np.bincount(cc, first[sl] - arr[sl] <= ttft_t[cc], nb)
            by["prompt"] += np.bincount(cc, pp, nb)
            by["gen"] += entering
            cum["prompt"] += float(pp.sum())
            cum["gen"] += len(oo)
            multi = oo > 1
            cum["fin"] += float(len(oo) - multi.sum())
            B += int(multi.sum())
            running += np.bincount(cc, multi, nb)
            kv_p += float(pp[multi].sum())
        # -- decode in the time prefill left
        if B and serving:
            tau = a + cs * B / serving + dk * K / serving
            n = max(dt - pre_time, 0.05 * dt) / tau
            step_time = dt / n
            if new > done_pre:  # entrants join at the step count of their first token
                s_in = S + n * np.clip((first[sl] - t0) / dt, 0.0, 1.0)
                last_step[sl] = s_in + oo - 1
                slots = last_step[sl][multi].astype(np.int64) % ring_len
                np.add.at(ring_n, (slots, cc[multi]), 1.0)
                np.add.at(ring_p, slots, pp[multi])
                np.add.at(ring_s0, slots, s_in[multi])
                kv_s0 += float(s_in[multi].sum())
            lo, hi = int(S) + 1, int(S + n)
            ended = made = np.zeros(nb)
            if hi >= lo:
                idx = np.arange(lo, min(hi, lo + ring_len - 1) + 1) % ring_len
                ended = ring_n[idx].sum(axis=0)
                # tokens of the ones ending: generated up to their own finish step, not the tick's end
                made = (np.arange(lo, lo + len(idx)) - S) @ ring_n[idx]
                kv_p -= ring_p[idx].sum()
                kv_s0 -= ring_s0[idx].sum()
                ring_n[idx] = 0.0
                ring_p[idx] = ring_s0[idx] = 0.0
            B -= int(round(ended.sum()))
            running -= ended
            S += n
            tokens = running * n + made
            cum["gen"] += float(tokens.sum())
            by["gen"] += tokens
            by["itl_n"] += tokens
            by["itl_ok"] += np.where(step_time <= tpot_t, tokens, 0.0)
            cum["fin"] += float(ended.sum())
            # overflow preempts: evicted tokens are recomputed (served before the queue) and then held again
            K = max(kv_p + B * S - kv_s0 - evicted, 0.0)
            cap = prof.kv_tokens * serving
            if K > cap and B:
                over = K - cap
                cum["preempt"] += math.ceil(over / (K / B))
                debt += over
                evicted += over
                K = cap
        done_pre = new
        if not B:
            kv_p = kv_s0 = evicted = K = 0.0
            running[:] = 0.0
        steps[k + 1] = S
        paid_s += (ready + len(starting) + len(draining)) * dt
        minute_paid[int(t0 // 60)] += (ready + len(starting) + len(draining)) * dt / 60
        # -- metrics and control
        if t1 % cfg.scrape_s < dt / 2 or cfg.scrape_s - t1 % cfg.scrape_s < dt / 2:
            snaps.append(RoleSignals(
                UNIFIED, t1, pods=serving, waiting=float(arrived - done_pre), running=float(B),
                kv_usage=K / (prof.kv_tokens * serving) if serving else 0.0, queued_prompt_tokens=queued,
                preemptions=cum["preempt"], prompt_tokens=cum["prompt"], generation_tokens=cum["gen"],
                finished=cum["fin"], ttft=histograms(targets, ttft_t, by["ttft_ok"], by["ttft_n"]),
                itl=histograms(targets, tpot_t, by["itl_ok"], by["itl_n"]),
                by_bucket={"prompt_tokens": dict(zip(targets, by["prompt"].tolist())),
                           "generation_tokens": dict(zip(targets, by["gen"].tolist()))}))
        if t1 % cfg.decide_s < dt / 2 or cfg.decide_s - t1 % cfg.decide_s < dt / 2:
            d = ctrl.decide(t1, visible(snaps, t1, cfg), Fleet(ready, len(starting)))
            if d.desired != desired:
                actions += 1
                reasons.append(f"t={t1:.0f}s {desired}->{d.desired}: {d.reason}")
            desired = d.desired
            while ready + len(starting) < desired:
                starting.append(t1 + prof.cold_start_s)
            while ready + len(starting) > desired and starting:
                starting.pop()  # not started yet: cancel the newest
            while ready > desired:
                ready -= 1  # stops taking prompts now, paid until its in-flight requests finish
                draining.append(t1 + min(0.5 * float(o.mean()) * step_time, 600.0))
    return finish(trace, cfg, name or type(ctrl).__name__, first, last_step, steps, paid_s, actions, minute_paid,
                  int(cum["preempt"]), reasons)


def histograms(targets: dict[str, SLO], bound: np.ndarray, ok: np.ndarray, n: np.ndarray) -> dict[str, Histogram]:
    """Per bucket, the share within its target: one bound at the target (none for no target)."""
    return {b: Histogram((x, math.inf), (k, m)) if math.isfinite(x) else Histogram((math.inf,), (m,))
            for b, x, k, m in zip(targets, bound.tolist(), ok.tolist(), n.tolist())}


def visible(snaps: list[RoleSignals], now: float, cfg: SimConfig) -> Window | None:
    """The window the controller can see: newest scrape older than the collection lag, against the
    scrape about `window_s` before it."""
    seen = [s for s in snaps[-int(cfg.window_s / cfg.scrape_s) - 4:] if s.t <= now - cfg.scrape_delay_s]
    if len(seen) < 2:
        return None
    new = seen[-1]
    old = next((s for s in reversed(seen) if s.t <= new.t - cfg.window_s), seen[0])
    return window(old, new, {b: (x.ttft_s, x.tpot_s) for b, x in cfg.targets().items()})


def crossing(curve: np.ndarray, level: np.ndarray, dt: float) -> np.ndarray:
    """First time a nondecreasing per-tick curve reaches each level, linear inside a tick (inf: never)."""
    j = np.searchsorted(curve, level, side="left")
    ok = j < len(curve)
    jj = np.clip(j, 1, len(curve) - 1)
    lo, hi = curve[jj - 1], curve[jj]
    frac = np.where(hi > lo, (level - lo) / np.where(hi > lo, hi - lo, 1.0), 1.0)
    return np.where(ok, (jj - 1 + np.clip(frac, 0.0, 1.0)) * dt, np.inf)


def finish(trace: Trace, cfg: SimConfig, name: str, first: np.ndarray, last_step: np.ndarray, steps: np.ndarray,
           paid_s: float, actions: int, minute_paid: np.ndarray, preemptions: int, reasons: list[str]) -> Result:
    targets, dt, cls = cfg.targets(), cfg.dt, trace.classes()
    arr, o = trace.arrival, trace.output.astype(np.float64)
    ttft = first - arr
    end = np.where(o > 1, crossing(steps, last_step, dt), first)
    with np.errstate(invalid="ignore"):  # inf - inf for requests that never started
        tpot = np.where(o > 1, (end - first) / np.maximum(o - 1, 1), 0.0)
    limit = lambda a: np.array([getattr(x, a) for x in targets.values()])[cls]  # noqa: E731 (each request's own)
    good = np.isfinite(end) & (ttft <= limit("ttft_s")) & (tpot <= limit("tpot_s")) & (end - arr <= limit("e2e_s"))
    per = np.bincount(cls, good, len(targets)) / np.maximum(np.bincount(cls, minlength=len(targets)), 1)
    minute = (arr // 60).astype(np.int64)
    total = np.bincount(minute)
    attained = np.bincount(minute, weights=good) / np.maximum(total, 1)
    attained[total == 0] = np.nan
    n = len(attained)
    ok = np.isfinite(ttft) & np.isfinite(tpot)
    return Result(name, trace.name, float(good.mean()), paid_s / 3600, actions,
                  float(np.median(ttft[np.isfinite(ttft)])) if ok.any() else math.inf,
                  float(np.median(tpot[ok])) if ok.any() else math.inf, preemptions,
                  np.arange(n) * 60.0, minute_paid[:n], attained, int(good.sum()), reasons,
                  dict(zip(targets, per.tolist())))
