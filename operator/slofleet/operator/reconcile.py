"""One reconcile of one LLMService: resolve inputs, apply the desired children, prune stale ones, report status.

Kept free of kopf so that it runs the same from every trigger (create/update/resume, the resync timer,
an event on a child) and from tests.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from slofleet.api.contract import ROLE_LABEL, ROUTER, now, parse_time, pod_url
from slofleet.api.v1alpha1 import Bucket, LLMService, SLOPolicy
from slofleet.operator import children, drain, engines, gateway, podspec, router, status, trust
from slofleet.operator.kube import Kube


@dataclass
class Outcome:
    created: list[str] = field(default_factory=list)  # "Kind/name"
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (reason, message) of a Warning event
    status: dict = field(default_factory=dict)
    requeue: float | None = None  # seconds until this service should be reconciled again (a drain in progress)


def resolve_buckets(kube: Kube, svc: LLMService, out: Outcome) -> list[Bucket]:
    if svc.spec.buckets or not svc.spec.policy_ref:
        return svc.spec.buckets
    raw = kube.get_policy(svc.metadata["namespace"], svc.spec.policy_ref)
    if raw is None:
        out.warnings.append(("PolicyNotFound",
                             f"SLOPolicy {svc.spec.policy_ref} not found: engines run without bucket priorities"))
        return []
    return SLOPolicy.model_validate(raw).spec.buckets


def reconcile(kube: Kube, body: dict, router_cluster_role: str = router.DEFAULT_CLUSTER_ROLE,
              autoscaler_namespace: str = trust.AUTOSCALER_NAMESPACE) -> Outcome:
    svc = LLMService.model_validate(body)
    ns, name = svc.metadata["namespace"], svc.metadata["name"]
    out = Outcome()
    if (memory := router.memory_warning(svc)) is not None:
        out.warnings.append(("RouterMemoryLow", memory))
    existing = kube.children(ns, name)
    # Drawn once, when the Secret is made; every later reconcile applies the token it holds.
    token = trust.token_of(existing.get(("Secret", podspec.secret_name(svc)))) or secrets.token_urlsafe(32)
    inputs = children.Inputs(buckets=resolve_buckets(kube, svc, out), internal_token=token,
                             service_monitor=kube.has_kind("monitoring.coreos.com/v1", "ServiceMonitor"),
                             inference_pool=kube.has_kind(gateway.INFERENCE_POOL_API, "InferencePool"),
                             network_policy=kube.has_kind("networking.k8s.io/v1", "NetworkPolicy"),
                             router_cluster_role=router_cluster_role, autoscaler_namespace=autoscaler_namespace)
    wanted = children.desired(svc, inputs)
    pods = status.by_role(kube.pods(ns, name))  # a crash loop shows in pods, not in the Deployment
    if scale_down_losslessly(kube, svc, wanted, existing, pods, token):
        out.requeue = drain.REQUEUE_SECONDS
    applied: dict[str, dict] = {}
    for obj in wanted:
        key = (obj["kind"], obj["metadata"]["name"])
        before = existing.pop(key, None)
        after = kube.apply(obj)
        label = f"{key[0]}/{key[1]}"
        if before is None:
            out.created.append(label)
        elif before["metadata"]["resourceVersion"] != after["metadata"]["resourceVersion"]:
            out.updated.append(label)
        applied[label] = after
    for (kind, child), obj in existing.items():
        # Only objects this resource controls: a same-labelled object someone else made is left alone.
        if any(ref.get("uid") == svc.metadata["uid"] for ref in obj["metadata"].get("ownerReferences") or []):
            kube.delete(obj)
            out.deleted.append(f"{kind}/{child}")
    roles = {}
    for d in wanted:
        if d["kind"] == "Deployment":
            role = d["metadata"]["labels"][ROLE_LABEL]
            roles[role] = status.observe(applied[f"Deployment/{d['metadata']['name']}"], d["spec"]["replicas"],
                                         pods.get(role, []))
    previous = body.get("status") or {}
    admission = children.router_admission(svc, inputs.buckets) if svc.spec.router.enabled else []
    out.status = status.status_patch(roles, svc.metadata.get("generation", 0), children.endpoint(svc),
                                     previous.get("conditions") or [], now(), previous.get("buckets") or [],
                                     [a.wire() for a in admission])
    # A role that left the topology leaves the status too (null deletes it in a merge patch).
    out.status["roles"].update({r: None for r in previous.get("roles") or {} if r not in roles})
    kube.patch_status(ns, name, out.status)
    return out


def scale_down_losslessly(kube: Kube, svc: LLMService, wanted: list[dict], existing: dict, pods: dict[str, list[dict]],
                          token: str) -> bool:
    """Drain the engine pods a lower count removes before lowering it (drain.py): sets each engine Deployment's
    replicas in `wanted` to what it may have now. True while a drained pod still has work."""
    ns, waiting = svc.metadata["namespace"], False
    for d in wanted:
        role = d["metadata"]["labels"].get(ROLE_LABEL)
        if d["kind"] != "Deployment" or role == ROUTER:
            continue
        before = existing.get(("Deployment", d["metadata"]["name"]))
        current, want = (before or {}).get("spec", {}).get("replicas"), d["spec"]["replicas"]
        live = [p for p in pods.get(role, []) if not p["metadata"].get("deletionTimestamp")]
        urls = {p["metadata"]["name"]: pod_url(p, svc.spec.engine.port) for p in live}
        load = ({n: engines.in_flight(u, svc.spec.engine.runtime) for n, u in urls.items()}
                if drain.scaling_down(current, want) else {})
        age = {p["metadata"]["name"]: time.time() - parse_time(since)
               for p in live if (since := drain.draining_since(p))}
        plan = drain.plan(current, want, live, load, age)
        d["spec"]["replicas"] = plan.replicas
        notes = {p["metadata"]["name"]: p["metadata"].get("annotations") or {} for p in live}
        for n in plan.drain:
            engines.set_draining(urls[n], token, True)  # before the annotation: the pod goes not ready at once
        for n in plan.resume:
            engines.set_draining(urls[n], token, False)
        for n, note in notes.items():
            change = {drain.DRAINING: (note.get(drain.DRAINING) or now()) if n in plan.drain else None,
                      drain.DELETION_COST: str(plan.costs[n]) if n in plan.costs else note.get(drain.DELETION_COST)}
            change = {k: v for k, v in change.items() if note.get(k) != v}
            if change:
                kube.annotate_pod(ns, n, change)
        waiting |= plan.waiting
    return waiting
