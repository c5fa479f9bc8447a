"""kopf wiring: which events trigger a reconcile. The work itself is in `reconcile.py`.

Triggers: the resource's create/update/resume, its autoscaler decision (status.autoscaling) and bucket verdicts
(status.buckets[].met); any event on a child (a deleted or edited Deployment is restored at once, and Deployment
status changes refresh the LLMService status); every 2 s while a scale-down waits for drained pods to empty
(drain.py); and a resync timer as a backstop for anything a watch missed (and for pods, which are not watched: a
crash loop reaches Degraded at the next resync).
"""
from __future__ import annotations

import threading
import time

import kopf

from slofleet.api.contract import MANAGED_BY
from slofleet.api.v1alpha1 import GROUP, VERSION
from slofleet.operator import drain, metrics, router, trust
from slofleet.operator import kube as kube_mod
from slofleet.operator.reconcile import Outcome, reconcile

PLURAL = "llmservices"
RETRY_SECONDS = 10  # after a failure a retry may cure (API server unreachable, a conflict, throttling, a bug)
_kube: kube_mod.Kube | None = None
# Triggers for one service arrive in bursts (every pod readiness change is a Deployment event). One reconcile
# runs per service at a time; triggers meanwhile mark it dirty and it runs once more, on a fresh read.
_guard = threading.Lock()
_running: set[tuple[str, str]] = set()
_dirty: set[tuple[str, str]] = set()
_decisions: dict[str, dict] = {}  # uid -> the last status.autoscaling and bucket verdicts seen
_router_cluster_role = router.DEFAULT_CLUSTER_ROLE  # set by register()
_autoscaler_namespace = trust.AUTOSCALER_NAMESPACE  # set by register()


def kube() -> kube_mod.Kube:
    global _kube
    if _kube is None:
        _kube = kube_mod.Kube(kube_mod.connect())
    return _kube


def run_reconcile(body: dict, trigger: str) -> None:
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    with _guard:
        if key in _running:
            _dirty.add(key)
            return
        _running.add(key)
    try:
        while True:
            if reconcile_once(body, trigger).requeue:
                again = threading.Timer(drain.REQUEUE_SECONDS, refresh, key + ("drain",))
                again.daemon = True
                again.start()
            with _guard:
                if key not in _dirty:
                    return
                _dirty.discard(key)
            fresh = kube().get(f"{GROUP}/{VERSION}", "LLMService", *key)
            if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                return
            body, trigger = fresh, "coalesced"
    finally:
        with _guard:
            _running.discard(key)
            _dirty.discard(key)


def refresh(namespace: str, name: str, trigger: str) -> None:
    """Reconcile a service again on a fresh read (a drain in progress is watched this way)."""
    fresh = kube().get(f"{GROUP}/{VERSION}", "LLMService", namespace, name)
    if fresh is not None and not fresh["metadata"].get("deletionTimestamp"):
        run_reconcile(fresh, trigger)


def reconcile_once(body: dict, trigger: str) -> Outcome:
    start = time.monotonic()
    try:
        out = reconcile(kube(), body, _router_cluster_role, _autoscaler_namespace)
    except Exception as e:
        metrics.RECONCILES.labels(trigger, "error").inc()
        kopf.warn(body, reason="ReconcileFailed", message=str(e)[:500])
        # kopf retries any other exception forever; a refusal stands until the resource (or the operator) changes
        if kube_mod.permanent(e):
            raise kopf.PermanentError(str(e)[:500]) from e
        raise kopf.TemporaryError(str(e)[:500], delay=RETRY_SECONDS) from e
    finally:
        metrics.DURATION.observe(time.monotonic() - start)
    metrics.RECONCILES.labels(trigger, "ok").inc()
    for action, items in (("created", out.created), ("updated", out.updated), ("deleted", out.deleted)):
        for item in items:
            metrics.CHANGES.labels(item.split("/")[0], action).inc()
        if items:
            kopf.info(body, reason=action.capitalize(), message=f"{action} {', '.join(items)} ({trigger})")
    for reason, message in out.warnings:
        kopf.warn(body, reason=reason, message=message)
    return out


def register(resync_seconds: float, router_cluster_role: str, autoscaler_namespace: str) -> None:
    """Registers the handlers on kopf's default registry (called once, before kopf.run)."""
    global _router_cluster_role, _autoscaler_namespace
    _router_cluster_role, _autoscaler_namespace = router_cluster_role, autoscaler_namespace

    @kopf.on.resume(GROUP, VERSION, PLURAL)
    @kopf.on.create(GROUP, VERSION, PLURAL)
    @kopf.on.update(GROUP, VERSION, PLURAL)
    def on_spec(body: kopf.Body, reason: kopf.Reason, **_) -> None:
        run_reconcile(dict(body), reason.value)

    @kopf.on.event(GROUP, VERSION, PLURAL)
    def on_decision(body: kopf.Body, type: str | None, **_) -> None:
        # kopf's update handlers ignore status, where the autoscaler writes its decision: watch it here, and
        # whether each bucket meets its SLO (status.buckets), which moves SLOMet.
        st = body.get("status", {})
        decision = {"autoscaling": dict(st.get("autoscaling") or {}),
                    "met": [(b.get("name"), b.get("met")) for b in st.get("buckets") or []]}
        uid = body["metadata"]["uid"]
        if type == "DELETED":
            _decisions.pop(uid, None)
            return
        if type in ("ADDED", "MODIFIED", None) and _decisions.get(uid, decision) != decision:
            _decisions[uid] = decision
            run_reconcile(dict(body), "autoscaler")
        _decisions.setdefault(uid, decision)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=resync_seconds, initial_delay=resync_seconds)
    def on_resync(body: kopf.Body, **_) -> None:
        run_reconcile(dict(body), "resync")

    for group_version, plural in (("v1", "configmaps"), ("apps/v1", "deployments"), ("v1", "services"),
                                  ("policy/v1", "poddisruptionbudgets"), ("v1", "serviceaccounts"),
                                  ("rbac.authorization.k8s.io/v1", "rolebindings"), ("v1", "secrets"),
                                  ("networking.k8s.io/v1", "networkpolicies")):
        kopf.on.event(group_version, plural, labels=MANAGED_BY)(on_child_event)


def on_child_event(body: kopf.Body, type: str | None, **_) -> None:
    if type is None:  # the initial listing: the resume handler covers it
        return
    meta = body["metadata"]
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("kind") == "LLMService"), None)
    if owner is None:
        return
    svc = kube().get(f"{GROUP}/{VERSION}", "LLMService", meta["namespace"], owner["name"])
    if svc is None or svc["metadata"]["uid"] != owner["uid"] or svc["metadata"].get("deletionTimestamp"):
        return  # the owner is gone: garbage collection removes the child
    run_reconcile(svc, f"{body.get('kind', 'child')} {type}".lower())
