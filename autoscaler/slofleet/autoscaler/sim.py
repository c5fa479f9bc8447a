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
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from slofleet.api.contract import DEFAULT_BUCKET, UNIFIED

from .fluid import Inputs, State, advance
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
        return self.buckets or {DEFAULT_BUCKET: self.slo}


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
    run = inputs(trace, cfg)
    st = initial_state(run, cfg)
    for k in range(run.ticks):
        t0, t1 = k * cfg.dt, (k + 1) * cfg.dt
        advance(run, st, cfg.dt, k, t0, t1)
        if t1 % cfg.scrape_s < cfg.dt / 2 or cfg.scrape_s - t1 % cfg.scrape_s < cfg.dt / 2:
            st.snaps.append(scrape(run, st, t1))
        if t1 % cfg.decide_s < cfg.dt / 2 or cfg.decide_s - t1 % cfg.decide_s < cfg.dt / 2:
            control(run, st, ctrl, cfg, t1)
    return finish(trace, cfg, name or type(ctrl).__name__, st.first, st.last_step, st.steps, st.paid_s, st.actions,
                  st.minute_paid, int(st.preemptions), st.reasons)


def inputs(trace: Trace, cfg: SimConfig) -> Inputs:
    prof, targets = cfg.profile, cfg.targets()
    p, o = trace.prompt.astype(np.float64), trace.output.astype(np.int64)
    ttft_t, tpot_t = (np.array([getattr(x, a) for x in targets.values()]) for a in ("ttft_s", "tpot_s"))
    return Inputs(prof=prof, targets=targets, arr=trace.arrival, p=p, o=o, cls=trace.classes(), nb=len(targets),
                  ttft_t=ttft_t, tpot_t=tpot_t, pos=np.cumsum(p),
                  alone=np.ceil(p / prof.token_budget) * prof.step_s + p * prof.prefill_token_s,
                  ticks=int(math.ceil((trace.duration + cfg.tail_s) / cfg.dt)),
                  ring_len=int(o.max()) + int(cfg.dt / prof.step_s) + 2)


def initial_state(run: Inputs, cfg: SimConfig) -> State:
    n, nb = len(run.p), run.nb
    return State(first=np.full(n, np.inf), last_step=np.full(n, np.inf), steps=np.zeros(run.ticks + 1),
                 ring_n=np.zeros((run.ring_len, nb)), ring_p=np.zeros(run.ring_len), ring_s0=np.zeros(run.ring_len),
                 running=np.zeros(nb), ready=cfg.initial, desired=cfg.initial,
                 minute_paid=np.zeros(run.ticks // int(60 / cfg.dt) + 2), by_prompt=np.zeros(nb),
                 by_gen=np.zeros(nb), ttft_ok=np.zeros(nb), ttft_n=np.zeros(nb), itl_ok=np.zeros(nb),
                 itl_n=np.zeros(nb), step_time=run.prof.step_s)


def scrape(run: Inputs, st: State, t1: float) -> RoleSignals:
    """The fleet's metrics as an engine exports them."""
    targets, serving = run.targets, st.serving
    return RoleSignals(
        UNIFIED, t1, pods=serving, waiting=float(st.arrived - st.done_pre), running=float(st.B),
        kv_usage=st.K / (run.prof.kv_tokens * serving) if serving else 0.0, queued_prompt_tokens=st.queued,
        preemptions=st.preemptions, prompt_tokens=st.prompt_total, generation_tokens=st.gen_total,
        finished=st.finished, ttft=histograms(targets, run.ttft_t, st.ttft_ok, st.ttft_n),
        itl=histograms(targets, run.tpot_t, st.itl_ok, st.itl_n),
        by_bucket={"prompt_tokens": dict(zip(targets, st.by_prompt.tolist())),
                   "generation_tokens": dict(zip(targets, st.by_gen.tolist()))})


def control(run: Inputs, st: State, ctrl: Controller, cfg: SimConfig, t1: float) -> None:
    """The controller's decision on what it can see, carried out: replicas asked for, cancelled or drained."""
    d = ctrl.decide(t1, visible(st.snaps, t1, cfg), Fleet(st.ready, len(st.starting)))
    if d.desired != st.desired:
        st.actions += 1
        st.reasons.append(f"t={t1:.0f}s {st.desired}->{d.desired}: {d.reason}")
    st.desired = d.desired
    while st.ready + len(st.starting) < st.desired:
        st.starting.append(t1 + run.prof.cold_start_s)
    while st.ready + len(st.starting) > st.desired and st.starting:
        st.starting.pop()  # not started yet: cancel the newest
    while st.ready > st.desired:
        st.ready -= 1  # stops taking prompts now, paid until its in-flight requests finish
        st.draining.append(t1 + min(0.5 * float(run.o.mean()) * st.step_time, 600.0))


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
