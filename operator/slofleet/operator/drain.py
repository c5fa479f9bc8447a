"""Pure: lossless scale-down. Before a role's Deployment loses replicas, the pods to go are drained and emptied.

A Deployment scaled down deletes pods of its choosing at once, and SIGTERM gives their requests only the grace
period: a long stream is cut. So when the wanted count drops below the Deployment's, the operator first picks the
pods with the least in-flight work, drains them (their /ready turns 503, so the routers and the Service stop
sending them work; in-flight requests run on), and keeps the Deployment's count until they are empty. Then it
lowers the count, and the ReplicaSet removes exactly those pods: they are not ready, and their
controller.kubernetes.io/pod-deletion-cost is the lowest (every other pod's is its in-flight work).

State lives on the pods (the annotation DRAINING, with the time the drain began), so a restarted operator carries
on; a drained pod that is wanted again (the count went back up) is resumed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DRAINING = "slofleet.dev/draining"  # pod annotation: the operator drains it for removal, since this time
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# A drained pod whose requests still run after this long is removed all the same: SIGTERM's grace period, and then
# an error event, ends them, as on a rollout.
DRAIN_LIMIT_SECONDS = 900
REQUEUE_SECONDS = 2.0  # how often a drain in progress is looked at again


@dataclass(frozen=True)
class Plan:
    replicas: int  # what the Deployment gets now
    drain: list[str] = field(default_factory=list)  # pods to drain (or keep drained: a restarted engine forgets)
    resume: list[str] = field(default_factory=list)  # pods drained before, wanted again
    costs: dict[str, int] = field(default_factory=dict)  # pod -> its pod-deletion-cost
    waiting: bool = False  # a drained pod still has work: look again in REQUEUE_SECONDS


def draining_since(pod: dict) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(DRAINING)


def scaling_down(current: int | None, wanted: int) -> bool:
    """Whether the Deployment is to lose replicas (and its pods' load is worth reading)."""
    return current is not None and wanted < current


def plan(current: int | None, wanted: int, pods: list[dict], load: dict[str, float | None],
         age: dict[str, float]) -> Plan:
    """`current`: the Deployment's replicas (None: no Deployment yet); `pods`: the role's pods not terminating;
    `load`: pod -> in-flight requests (None: unknown, e.g. unreachable: treated as idle, the grace period then
    covers it); `age`: pod -> seconds since its drain began."""
    names = [p["metadata"]["name"] for p in pods]
    drained = sorted(p["metadata"]["name"] for p in pods if draining_since(p))
    excess = max(0, len(pods) - wanted)
    if not scaling_down(current, wanted):
        # Drained pods stay so until the ReplicaSet removes them; those beyond the excess are wanted again.
        return Plan(wanted, resume=drained[excess:])
    # Pods drained before first (a drain in progress is not moved elsewhere), then the least loaded.
    order = sorted(names, key=lambda n: (n not in drained, load.get(n) or 0.0, n))
    go = order[:excess]
    costs = {n: -1 if n in go else min(int(load.get(n) or 0), 2 ** 31 - 1) for n in names}
    busy = [n for n in go if (load.get(n) or 0) > 0 and age.get(n, 0.0) < DRAIN_LIMIT_SECONDS]
    return Plan(current if busy else wanted, drain=go, resume=[n for n in drained if n not in go], costs=costs,
                waiting=bool(busy))
