"""Pure: the observed Deployments and pods of a service -> its status (per-role replicas, conditions, endpoint);
SLOMet from the autoscaler's status.buckets, so that the operator stays the one writer of the conditions."""
from __future__ import annotations

from dataclasses import dataclass

from slofleet.api.contract import ROLE_LABEL

# Container states in which a pod does not come back by itself: a crash loop, or a container that cannot start.
STUCK = {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
         "CreateContainerError", "RunContainerError"}


@dataclass(frozen=True)
class RoleObservation:
    desired: int  # what the operator asked for
    replicas: int  # .status.replicas
    ready: int  # .status.readyReplicas
    updated: int  # .status.updatedReplicas
    current_generation: bool  # the Deployment controller has seen its latest spec
    failure: str = ""  # message of a ReplicaFailure / ProgressDeadlineExceeded condition
    pod_failure: str = ""  # a pod of the role crash-looping, unable to start, or unschedulable


def pod_failure(pods: list[dict]) -> str:
    """Why the first stuck pod of these is stuck (and how many more are), as the kubelet and scheduler say."""
    why = []
    for p in pods:
        st = p.get("status") or {}
        for c in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            reason = ((c.get("state") or {}).get("waiting") or {}).get("reason")
            if reason in STUCK:
                last = (c.get("lastState") or {}).get("terminated") or {}
                exit_ = f", last exit {last.get('exitCode')} {last.get('reason', '')}".rstrip() if last else ""
                why.append(f"pod {p['metadata']['name']}: container {c['name']} {reason} "
                           f"({c.get('restartCount', 0)} restarts{exit_})")
                break
        else:
            unscheduled = [c for c in st.get("conditions") or [] if c.get("type") == "PodScheduled"
                           and c.get("status") == "False" and c.get("reason") == "Unschedulable"]
            if unscheduled:
                why.append(f"pod {p['metadata']['name']}: unschedulable: {unscheduled[0].get('message', '')}")
    return why[0] + (f" (and {len(why) - 1} more pods)" if len(why) > 1 else "") if why else ""


def by_role(pods: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in pods:
        out.setdefault((p["metadata"].get("labels") or {}).get(ROLE_LABEL, ""), []).append(p)
    return out


def observe(deployment: dict | None, desired: int, pods: list[dict] = ()) -> RoleObservation:
    if deployment is None:
        return RoleObservation(desired, 0, 0, 0, False, "", pod_failure(list(pods)))
    st = deployment.get("status") or {}
    failure = ""
    for c in st.get("conditions") or []:
        if (c.get("type") == "ReplicaFailure" and c.get("status") == "True") or \
                (c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"):
            failure = c.get("message") or c.get("reason", "")
    gen_seen = st.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
    return RoleObservation(desired, st.get("replicas", 0), st.get("readyReplicas", 0),
                           st.get("updatedReplicas", 0), gen_seen, failure, pod_failure(list(pods)))


def slo_met(buckets: list[dict]) -> tuple[bool | None, str, str]:
    """(status, reason, message) of SLOMet: True when every bucket with requests in the window meets its SLO,
    Unknown when none had any; the message names the worst bucket (a missed one before any met)."""
    judged = [b for b in buckets or [] if b.get("attainment") is not None]
    if not judged:
        return None, "NoRequests", "no bucket had requests in the window"
    worst = min(judged, key=lambda b: (bool(b.get("met")), b["attainment"]))
    ok = all(b.get("met") for b in judged)
    p = f"p{worst.get('percentile', 99):g}"
    at = ", ".join(f"{p} {k[:-2].upper()} {worst[k]:g} ms" for k in ("ttftMs", "tpotMs", "e2eMs") if k in worst)
    message = (f"{'worst' if ok else 'missed'}: bucket {worst['name']}, attainment {worst['attainment']:g} of "
               f"{worst.get('requests', 0)} requests in {worst.get('windowSeconds', 0)} s ({at})")
    return ok, "AllBucketsMet" if ok else "BucketMissed", message


def _condition(type_: str, ok: bool | None, reason: str, message: str, generation: int, previous: dict[str, dict],
               now: str) -> dict:
    status = "Unknown" if ok is None else "True" if ok else "False"
    prev = previous.get(type_)
    # lastTransitionTime moves only when the status flips, as Kubernetes conventions ask.
    kept = prev and prev.get("status") == status and prev.get("lastTransitionTime")
    since = prev["lastTransitionTime"] if kept else now
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def conditions(roles: dict[str, RoleObservation], generation: int, previous: list[dict], now: str,
               buckets: list[dict] = ()) -> list[dict]:
    prev = {c["type"]: c for c in previous or []}
    ready = all(o.ready >= o.desired for o in roles.values())
    rolling = [r for r, o in roles.items()
               if not o.current_generation or o.updated < o.desired or o.replicas > o.desired or o.ready < o.desired]
    failed = {r: "; ".join(m for m in (o.pod_failure, o.failure) if m) for r, o in roles.items()
              if o.failure or o.pod_failure}
    why = "PodsFailing" if any(o.pod_failure for o in roles.values()) else "DeploymentFailing"
    not_ready = ", ".join(f"{r} {o.ready}/{o.desired}" for r, o in roles.items() if o.ready < o.desired)
    return [
        _condition("Ready", ready, "AllReplicasReady" if ready else "ReplicasNotReady",
                   "all roles have their desired ready replicas" if ready else f"ready: {not_ready}",
                   generation, prev, now),
        _condition("Progressing", bool(rolling), "RollingOut" if rolling else "Stable",
                   f"rolling out: {', '.join(rolling)}" if rolling else "every role runs the current spec",
                   generation, prev, now),
        _condition("Degraded", bool(failed), why if failed else "AsExpected",
                   "; ".join(f"{r}: {m}" for r, m in failed.items()) or "no failures", generation, prev, now),
        _condition("SLOMet", *slo_met(list(buckets)), generation, prev, now),
    ]


def status_patch(roles: dict[str, RoleObservation], generation: int, endpoint: str, previous: list[dict],
                 now: str, buckets: list[dict] = (), router_admission: list[dict] = ()) -> dict:
    """The operator's part of .status; .status.autoscaling and .status.buckets belong to the autoscaler and are left
    alone (`buckets` is what it wrote, read for SLOMet). `router_admission`: what each router enforces."""
    return {
        "observedGeneration": generation,
        "endpoint": endpoint,
        "routerAdmission": list(router_admission),
        "roles": {r: {"replicas": o.replicas, "readyReplicas": o.ready, "desiredReplicas": o.desired}
                  for r, o in roles.items()},
        "conditions": conditions(roles, generation, previous, now, buckets),
    }
