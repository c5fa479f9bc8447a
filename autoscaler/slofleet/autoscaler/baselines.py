"""What users run today, as controllers for the same simulator (same `decide(now, win, fleet)` shape)."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .policy import Decision, Fleet
from .profiles import Profile
from .signals import Window
from .traces import Trace


@dataclass
class Static:
    replicas: int

    def decide(self, now: float, win: Window | None, fleet: Fleet) -> Decision:
        return Decision(self.replicas, f"static {self.replicas}")


@dataclass
class HPABehavior:
    """Kubernetes HPA defaults: 10% tolerance, scale-up at once (at most double or +4 pods per 15 s),
    scale-down to the highest recommendation of the last 300 s."""
    min_replicas: int = 1
    max_replicas: int = 64
    down_window_s: float = 300.0
    tolerance: float = 0.1
    recs: deque = field(default_factory=deque)

    def apply(self, now: float, ratio: float | None, fleet: Fleet, why: str) -> Decision:
        cur = max(fleet.total, 1)
        if ratio is None:  # no metric: HPA keeps the current scale
            return Decision(fleet.total, "no metric")
        rec = cur if abs(ratio - 1.0) <= self.tolerance else math.ceil(cur * ratio)
        rec = min(max(rec, self.min_replicas), self.max_replicas, max(2 * cur, cur + 4))
        self.recs.append((now, rec))
        while self.recs[0][0] < now - self.down_window_s:
            self.recs.popleft()
        if rec < cur:
            rec = min(cur, max(r for _, r in self.recs))
        return Decision(rec, why)


@dataclass
class HPA:
    """HPA on utilisation: the share of each replica's capacity in use (an SM-activity-like figure; plain
    GPU 'busy' time reads ~100% whenever anything is decoding and would only ever scale up)."""
    profile: Profile
    tpot_s: float
    target: float = 0.7
    hpa: HPABehavior = field(default_factory=HPABehavior)

    def decide(self, now: float, win: Window | None, fleet: Fleet) -> Decision:
        if win is None or not fleet.ready or win.mean_prompt is None or win.mean_output is None:
            return self.hpa.apply(now, None, fleet, "")
        pre, dec = self.profile.rates(win.mean_prompt, win.mean_output, self.tpot_s)
        util = min((win.prompt_rate / pre + win.output_rate / dec) / fleet.ready, 1.0)
        if util > self.target and fleet.starting:  # as Kubernetes does: a pod not ready counts as idle to scale up
            util *= fleet.ready / fleet.total
        return self.hpa.apply(now, util / self.target, fleet, f"utilisation {util:.0%} vs {self.target:.0%}")


@dataclass
class KEDAQueue:
    """KEDA on vllm:num_requests_waiting, AverageValue target 5: desired = ceil(waiting / 5)."""
    threshold: float = 5.0
    hpa: HPABehavior = field(default_factory=HPABehavior)

    def decide(self, now: float, win: Window | None, fleet: Fleet) -> Decision:
        if win is None:
            return self.hpa.apply(now, None, fleet, "")
        want = max(math.ceil(win.now.waiting / self.threshold), 1)
        return self.hpa.apply(now, want / max(fleet.total, 1), fleet, f"{win.now.waiting:.0f} waiting")


@dataclass
class Thresholds:
    """Dynamo-planner / llm-d-WVA style load rules: one replica up when KV usage or the queue per replica
    passes its threshold, one down when both are low; at most one change per interval."""
    kv_up: float = 0.85  # between WVA's 0.8 and Dynamo's 0.9
    kv_down: float = 0.5
    queue_up: float = 5.0
    queue_down: float = 0.5
    interval_s: float = 60.0
    min_replicas: int = 1
    max_replicas: int = 64
    last: float = -math.inf

    def decide(self, now: float, win: Window | None, fleet: Fleet) -> Decision:
        if win is None or now - self.last < self.interval_s:
            return Decision(fleet.total, "waiting for the next interval")
        s, ready = win.now, max(fleet.ready, 1)
        q = s.waiting / ready
        if s.kv_usage > self.kv_up or q > self.queue_up:
            self.last = now
            return Decision(min(fleet.total + 1, self.max_replicas), f"KV {s.kv_usage:.0%}, queue {q:.1f}: +1")
        if s.kv_usage < self.kv_down and q < self.queue_down and not fleet.starting:
            self.last = now
            return Decision(max(fleet.total - 1, self.min_replicas), f"KV {s.kv_usage:.0%}, queue {q:.1f}: -1")
        return Decision(fleet.total, "within thresholds")


class Oracle:
    """Knows the trace: asks, one cold start ahead, for the replicas the coming minutes need at
    `utilization` of the profile's capacity. A reference, not a policy anyone can run."""

    def __init__(self, trace: Trace, profile: Profile, tpot_s: float, utilization: float = 0.85,
                 min_replicas: int = 1, max_replicas: int = 64):
        minute = (trace.arrival // 60).astype(np.int64)
        pre, dec = profile.rates(float(trace.prompt.mean()), float(trace.output.mean()), tpot_s)
        work = np.bincount(minute, weights=trace.prompt / pre + trace.output / dec) / 60.0
        self.need = np.ceil(work / utilization)
        self.ahead = profile.cold_start_s
        self.bounds = (min_replicas, max_replicas)

    def decide(self, now: float, win: Window | None, fleet: Fleet) -> Decision:
        horizon = self.need[int(now // 60):int((now + self.ahead) // 60) + 3]
        want = int(horizon.max()) if len(horizon) else self.bounds[0]
        return Decision(min(max(want, self.bounds[0]), self.bounds[1]), "oracle: the coming minutes' load")
