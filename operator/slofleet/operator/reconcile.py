"""One reconcile of one LLMService: resolve inputs, apply the desired children, prune stale ones, report status.

Kept free of kopf so that it runs the same from every trigger (create/update/resume, the resync timer,
an event on a child) and from tests.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from slofleet.api.contract import ROLE_LABEL, now
from slofleet.api.v1alpha1 import Bucket, LLMService, SLOPolicy
from slofleet.operator import children, podspec, router, status, trust
from slofleet.operator.kube import Kube


@dataclass
class Outcome:
    created: list[str] = field(default_factory=list)  # "Kind/name"
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    status: dict = field(default_factory=dict)


def resolve_buckets(kube: Kube, svc: LLMService, out: Outcome) -> list[Bucket]:
    if svc.spec.buckets or not svc.spec.policy_ref:
        return svc.spec.buckets
    raw = kube.get_policy(svc.metadata["namespace"], svc.spec.policy_ref)
    if raw is None:
        out.warnings.append(f"SLOPolicy {svc.spec.policy_ref} not found: engines run without bucket priorities")
        return []
    return SLOPolicy.model_validate(raw).spec.buckets


def reconcile(kube: Kube, body: dict, router_cluster_role: str = router.DEFAULT_CLUSTER_ROLE,
              autoscaler_namespace: str = trust.AUTOSCALER_NAMESPACE) -> Outcome:
    svc = LLMService.model_validate(body)
    ns, name = svc.metadata["namespace"], svc.metadata["name"]
    out = Outcome()
    existing = kube.children(ns, name)
    # Drawn once, when the Secret is made; every later reconcile applies the token it holds.
    token = trust.token_of(existing.get(("Secret", podspec.secret_name(svc)))) or secrets.token_urlsafe(32)
    inputs = children.Inputs(buckets=resolve_buckets(kube, svc, out), internal_token=token,
                             service_monitor=kube.has_kind("monitoring.coreos.com/v1", "ServiceMonitor"),
                             network_policy=kube.has_kind("networking.k8s.io/v1", "NetworkPolicy"),
                             router_cluster_role=router_cluster_role, autoscaler_namespace=autoscaler_namespace)
    wanted = children.desired(svc, inputs)
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
    pods = status.by_role(kube.pods(ns, name))  # a crash loop shows in pods, not in the Deployment
    for d in wanted:
        if d["kind"] == "Deployment":
            role = d["metadata"]["labels"][ROLE_LABEL]
            roles[role] = status.observe(applied[f"Deployment/{d['metadata']['name']}"], d["spec"]["replicas"],
                                         pods.get(role, []))
    previous = body.get("status") or {}
    out.status = status.status_patch(roles, svc.metadata.get("generation", 0), children.endpoint(svc),
                                     previous.get("conditions") or [], now(), previous.get("buckets") or [])
    # A role that left the topology leaves the status too (null deletes it in a merge patch).
    out.status["roles"].update({r: None for r in previous.get("roles") or {} if r not in roles})
    kube.patch_status(ns, name, out.status)
    return out
