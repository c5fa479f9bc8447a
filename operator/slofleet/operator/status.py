"""Pure: the observed Deployments of a service -> its status (per-role replicas, conditions, endpoint)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoleObservation:
    desired: int  # what the operator asked for
    replicas: int  # .status.replicas
    ready: int  # .status.readyReplicas
    updated: int  # .status.updatedReplicas
    current_generation: bool  # the Deployment controller has seen its latest spec
    failure: str = ""  # message of a ReplicaFailure / ProgressDeadlineExceeded condition


def observe(deployment: dict | None, desired: int) -> RoleObservation:
    if deployment is None:
        return RoleObservation(desired, 0, 0, 0, False, "")
    st = deployment.get("status") or {}
    failure = ""
    for c in st.get("conditions") or []:
        if (c.get("type") == "ReplicaFailure" and c.get("status") == "True") or \
                (c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"):
            failure = c.get("message") or c.get("reason", "")
    gen_seen = st.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
    return RoleObservation(desired, st.get("replicas", 0), st.get("readyReplicas", 0),
                           st.get("updatedReplicas", 0), gen_seen, failure)


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int, previous: dict[str, dict],
               now: str) -> dict:
    status = "True" if ok else "False"
    prev = previous.get(type_)
    # lastTransitionTime moves only when the status flips, as Kubernetes conventions ask.
    kept = prev and prev.get("status") == status and prev.get("lastTransitionTime")
    since = prev["lastTransitionTime"] if kept else now
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def conditions(roles: dict[str, RoleObservation], generation: int, previous: list[dict], now: str) -> list[dict]:
    prev = {c["type"]: c for c in previous or []}
    ready = all(o.ready >= o.desired for o in roles.values())
    rolling = [r for r, o in roles.items()
               if not o.current_generation or o.updated < o.desired or o.replicas > o.desired or o.ready < o.desired]
    failed = {r: o.failure for r, o in roles.items() if o.failure}
    not_ready = ", ".join(f"{r} {o.ready}/{o.desired}" for r, o in roles.items() if o.ready < o.desired)
    return [
        _condition("Ready", ready, "AllReplicasReady" if ready else "ReplicasNotReady",
                   "all roles have their desired ready replicas" if ready else f"ready: {not_ready}",
                   generation, prev, now),
        _condition("Progressing", bool(rolling), "RollingOut" if rolling else "Stable",
                   f"rolling out: {', '.join(rolling)}" if rolling else "every role runs the current spec",
                   generation, prev, now),
        _condition("Degraded", bool(failed), "DeploymentFailing" if failed else "AsExpected",
                   "; ".join(f"{r}: {m}" for r, m in failed.items()) or "no failures", generation, prev, now),
    ]


def status_patch(roles: dict[str, RoleObservation], generation: int, endpoint: str, previous: list[dict],
                 now: str) -> dict:
    """The operator's part of .status; .status.autoscaling belongs to the autoscaler and is left alone."""
    return {
        "observedGeneration": generation,
        "endpoint": endpoint,
        "roles": {r: {"replicas": o.replicas, "readyReplicas": o.ready, "desiredReplicas": o.desired}
                  for r, o in roles.items()},
        "conditions": conditions(roles, generation, previous, now),
    }
