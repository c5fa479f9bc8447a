"""The operator's conditions from what it sees: SLOMet from the autoscaler's status.buckets (the operator stays the
one writer of the conditions), and Degraded from pods that crash-loop, cannot start or cannot be scheduled."""
from __future__ import annotations

from slofleet.operator import status

DEP = {"metadata": {"generation": 1},
       "status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 1}}


def conds(buckets=(), pods=()) -> dict[str, dict]:
    roles = {"unified": status.observe(DEP, 1, list(pods))}
    return {c["type"]: c for c in status.conditions(roles, 1, [], "T", list(buckets))}


def pod(name: str, **container) -> dict:
    return {"metadata": {"name": name, "labels": {"slofleet.dev/role": "unified"}},
            "status": {"containerStatuses": [{"name": "engine", **container}]}}


def test_slo_met_names_the_worst_bucket():
    met = {"name": "chat", "requests": 5, "attainment": 1.0, "met": True, "percentile": 99, "windowSeconds": 300,
           "ttftMs": 80.0}
    missed = {"name": "strict", "requests": 5, "attainment": 0.2, "met": False, "percentile": 90,
              "windowSeconds": 300, "ttftMs": 40.5, "e2eMs": 900.0}
    c = conds([met, missed])["SLOMet"]
    assert (c["status"], c["reason"]) == ("False", "BucketMissed")
    assert c["message"] == "missed: bucket strict, attainment 0.2 of 5 requests in 300 s (p90 TTFT 40.5 ms, " \
                           "p90 E2E 900 ms)"
    ok = conds([met, {"name": "idle", "requests": 0, "percentile": 99}])["SLOMet"]  # no requests: not judged
    assert (ok["status"], ok["reason"]) == ("True", "AllBucketsMet") and "bucket chat" in ok["message"]
    # A met bucket of lower attainment than another met one is the worst of them.
    worst = conds([met, {**met, "name": "doc", "attainment": 0.995}])["SLOMet"]
    assert "bucket doc" in worst["message"]
    none = conds([{"name": "idle", "requests": 0}])["SLOMet"]
    assert (none["status"], none["reason"]) == ("Unknown", "NoRequests")


def test_a_crash_loop_or_a_pod_that_cannot_start_is_degraded():
    crash = pod("s-unified-1", restartCount=7, state={"waiting": {"reason": "CrashLoopBackOff"}},
                lastState={"terminated": {"exitCode": 1, "reason": "Error"}})
    d = conds(pods=[crash])["Degraded"]
    assert (d["status"], d["reason"]) == ("True", "PodsFailing")
    assert d["message"] == "unified: pod s-unified-1: container engine CrashLoopBackOff (7 restarts, last exit 1 Error)"
    image = pod("s-unified-2", state={"waiting": {"reason": "ImagePullBackOff"}})
    assert "(and 1 more pods)" in conds(pods=[crash, image])["Degraded"]["message"]
    unschedulable = {"metadata": {"name": "s-unified-3"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes: no GPU"}]}}
    assert conds(pods=[unschedulable])["Degraded"]["message"] == \
        "unified: pod s-unified-3: unschedulable: 0/1 nodes: no GPU"
    starting = pod("s-unified-4", restartCount=0, state={"waiting": {"reason": "ContainerCreating"}})
    running = pod("s-unified-5", restartCount=2, state={"running": {}})
    assert conds(pods=[starting, running])["Degraded"]["status"] == "False"


def test_pods_are_grouped_by_their_role():
    router = {"metadata": {"name": "r", "labels": {"slofleet.dev/role": "router"}}}
    engine = pod("e")
    assert status.by_role([router, engine]) == {"router": [router], "unified": [engine]}
