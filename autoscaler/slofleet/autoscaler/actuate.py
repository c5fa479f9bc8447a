"""Pure: an LLMService -> per-role policy settings, and a decision -> its status entry and Event.

The API calls are in `kube.py` and the loop in `kubemode.py`; everything here is decided without them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from slofleet.api.contract import DEFAULT_BUCKET
from slofleet.api.v1alpha1 import Bucket, LLMService, RoleAutoscaling

from .policy import SLO, Decision, PolicyConfig

WINDOW_INTERVALS = 4  # each decision reads this many intervals of history
STALE_INTERVALS = 3  # no fresh scrape for this many intervals: metrics are stale
MESSAGE_LIMIT = 1024  # the API server's limit on an Event message


@dataclass(frozen=True)
class RoleSettings:
    policy: PolicyConfig
    slo: dict[str, tuple[float, ...]]  # bucket -> (TTFT s, TPOT s, E2E s), what `signals.window` measures against
    window_s: float


def bucket_slos(buckets: list[Bucket]) -> dict[str, SLO]:
    """Each bucket's targets (one it does not set: none, infinite) at its own percentile."""
    s = lambda ms: math.inf if ms is None else ms / 1000  # noqa: E731
    return {b.name: SLO(s(b.slo.ttft_ms), s(b.slo.tpot_ms), b.slo.percentile / 100, s(b.slo.e2e_ms)) for b in buckets}


def slo_targets(buckets: list[Bucket]) -> tuple[SLO, dict[str, tuple[float, ...]]]:
    """Per-bucket targets, and the policy's own SLO (for what no bucket sets, e.g. the TPOT a scale-down's
    in-flight work is estimated at): the strictest targets and percentile."""
    per, default = bucket_slos(buckets), SLO()
    if not per:
        return default, {DEFAULT_BUCKET: (default.ttft_s, default.tpot_s)}
    strictest = lambda got, fallback: min((t for t in got if math.isfinite(t)), default=fallback)  # noqa: E731
    return (SLO(strictest([b.ttft_s for b in per.values()], default.ttft_s),
                strictest([b.tpot_s for b in per.values()], default.tpot_s), max(b.target for b in per.values())),
            {name: (b.ttft_s, b.tpot_s, b.e2e_s) for name, b in per.items()})


def settings(svc: LLMService, buckets: list[Bucket], base: PolicyConfig) -> dict[str, RoleSettings]:
    """Each role's policy from the resource: bounds from spec.topology, timing and signals from spec.autoscaling,
    each bucket's SLO at its percentile, the time in-flight work has to finish from spec.engine.drainSeconds;
    the capacity priors and cold start from `base` (the command line)."""
    a = svc.spec.autoscaling
    slo, per_bucket = slo_targets(buckets)
    return {role: RoleSettings(dataclasses.replace(
                base, role=role, slo=slo, buckets=bucket_slos(buckets), min_replicas=pool.min_replicas,
                max_replicas=pool.max_replicas, up_window_s=a.scale_up_stabilization_seconds,
                down_window_s=a.scale_down_stabilization_seconds, kv_high=a.target_kv_cache_usage,
                stale_after_s=STALE_INTERVALS * a.interval_seconds, grace_s=svc.spec.engine.drain_seconds,
                signals=frozenset(a.signals)),
                per_bucket, WINDOW_INTERVALS * a.interval_seconds)
            for role, pool in svc.spec.topology.pools().items()}


def scale_from_zero(d: Decision, total: int, held: float | None) -> Decision:
    """A role with no replicas has no metrics of its own; requests the router holds for it are the signal."""
    if total == 0 and d.desired == 0 and held:
        return Decision(1, f"scale from zero to 1: the router holds {held:.0f} requests", "Ok")
    return d


def entry(d: Decision, previous: RoleAutoscaling | None, when: str) -> RoleAutoscaling:
    """The decision as status.autoscaling.<role>. Stale metrics with no decision on record leave
    desiredReplicas out: there is nothing to hold, and asking for the current count would be scaling on no data."""
    desired: int | None = d.desired
    if d.condition == "MetricsStale" and (previous is None or previous.desired_replicas is None):
        desired = None
    return RoleAutoscaling(desired_replicas=desired, reason=d.reason[:MESSAGE_LIMIT], time=when, condition=d.condition)


def status_patch(role: str, e: RoleAutoscaling) -> dict:
    """A merge patch of one role's entry: other roles' entries and the operator's fields are left alone."""
    return {"status": {"autoscaling": {role: e.wire()}}}


def changed(written: RoleAutoscaling | None, e: RoleAutoscaling) -> bool:
    """Worth a write: the count or the condition moved (the reason's figures move every interval)."""
    return written is None or (written.desired_replicas, written.condition) != (e.desired_replicas, e.condition)


def event(role: str, before: RoleAutoscaling | None, current: int, e: RoleAutoscaling) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event a new entry deserves, or None. `current` is the count asked for
    before (the previous decision, else the replicas running)."""
    old = before.desired_replicas if before and before.desired_replicas is not None else current
    was_stale = before is not None and before.condition == "MetricsStale"
    msg = lambda head: f"{role}: {head}: {e.reason}"[:MESSAGE_LIMIT]  # noqa: E731
    if e.desired_replicas is not None and e.desired_replicas != old:
        verb = "ScaledUp" if e.desired_replicas > old else "ScaledDown"
        return "Normal", verb, msg(f"{old} -> {e.desired_replicas}")
    if e.condition == "MetricsStale" and not was_stale:
        return "Warning", "MetricsStale", msg("holding")
    if was_stale and e.condition != "MetricsStale":
        return "Normal", "MetricsRecovered", msg("deciding again")
    return None
