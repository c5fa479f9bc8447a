"""Pure: an LLMService (plus the buckets it resolves to) -> the objects the operator keeps in the cluster.

No API calls here: the handlers fetch, call `desired()`, and server-side-apply what it returns.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from slofleet.api.contract import DECODE, ROLE_LABEL, SERVICE_LABEL, UNIFIED
from slofleet.api.v1alpha1 import API_VERSION, Admission, Bucket, BucketAdmission, LLMService, Pool, RoleAutoscaling
from slofleet.operator import gateway, router, trust
from slofleet.operator.podspec import labels, pod_template


@dataclass(frozen=True)
class Inputs:
    """Everything besides the resource itself that decides the children."""
    buckets: list[Bucket]  # spec.buckets, or the referenced SLOPolicy's
    internal_token: str  # the Secret's (drawn once by reconcile.py, then read back from the Secret)
    service_monitor: bool = False  # the ServiceMonitor CRD exists in the cluster
    inference_pool: bool = False  # the InferencePool CRD (Gateway API Inference Extension) exists in the cluster
    network_policy: bool = False  # the API server serves NetworkPolicies
    router_cluster_role: str = router.DEFAULT_CLUSTER_ROLE  # what the router's RoleBinding grants (see router.py)
    autoscaler_namespace: str = trust.AUTOSCALER_NAMESPACE  # its pods may scrape the engines


def replicas(pool: Pool, autoscaling_on: bool, decision: RoleAutoscaling | None) -> int:
    """One writer per field: the autoscaler's decision (from status) clamped to the user's bounds;
    without autoscaling, the fixed count."""
    if autoscaling_on and decision is not None and decision.desired_replicas is not None:
        return max(pool.min_replicas, min(pool.max_replicas, decision.desired_replicas))
    return pool.replicas if pool.replicas is not None else pool.min_replicas


def endpoint(svc: LLMService) -> str:
    """Where clients send requests: the router, else (router off) the engines that run whole requests."""
    m, ns = svc.metadata, svc.metadata.get("namespace", "default")
    if svc.spec.router.enabled:
        return f"http://{router.name_of(svc)}.{ns}.svc:{svc.spec.router.port}"
    role = UNIFIED if svc.spec.topology.mode == "unified" else DECODE
    return f"http://{m['name']}-{role}.{ns}.svc:{svc.spec.engine.port}"


def owner_reference(svc: LLMService) -> dict:
    m = svc.metadata
    return {"apiVersion": API_VERSION, "kind": "LLMService", "name": m["name"], "uid": m["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _meta(svc: LLMService, name: str, role: str | None = None) -> dict:
    return {"name": name, "namespace": svc.metadata.get("namespace", "default"),
            "labels": labels(svc.metadata["name"], role), "ownerReferences": [owner_reference(svc)]}


def router_admission(svc: LLMService, buckets: list[Bucket]) -> list[BucketAdmission]:
    """Each bucket's admission limits as each router replica enforces them: the service's divided among the
    replicas, so that together they hold (a count at least 1, or a router could admit nothing)."""
    n = svc.spec.router.replicas
    count = lambda v: v if not v else max(1, v // n)  # noqa: E731 (None: no limit, 0: refuse all)
    return [BucketAdmission(name=b.name, mode=a.mode, max_waiting_requests=count(a.max_waiting_requests),
                            max_queued_tokens=count(a.max_queued_tokens),
                            max_requests_per_second=a.max_requests_per_second and a.max_requests_per_second / n)
            for b in buckets if (a := b.admission) != Admission()]


def config_map(svc: LLMService, inputs: Inputs) -> dict:
    """The buckets the router reads from its mounted policy.json (and re-reads when it changes), with each
    router replica's share of their admission limits."""
    shares = {a.name: a for a in router_admission(svc, inputs.buckets)}
    buckets = [b.model_copy(update={"admission": Admission.model_validate(shares[b.name].model_dump(exclude={"name"}))})
               if b.name in shares else b for b in inputs.buckets]
    # the mode in force, spelled out, so that the router's file says how each bucket is admitted
    buckets = [b.model_copy(update={"admission": b.admission.model_copy(update={"mode": b.admission_mode()})})
               for b in buckets]
    policy = {"model": svc.spec.model.wire(), "buckets": [b.wire() for b in buckets],
              "topology": svc.spec.topology.mode}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(svc, f"{svc.metadata['name']}-engine"),
            "data": {"policy.json": json.dumps(policy, sort_keys=True, indent=2)}}


def config_hash(token: str) -> str:
    # In the pod templates, so that a new token (a Secret edited or deleted and drawn anew) rolls every pod: a
    # container reads its env from the Secret only when it starts. The buckets are not in it: the router re-reads
    # them, and the engines take them as flags only without a router.
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def deployment(svc: LLMService, role: str, count: int, inputs: Inputs) -> dict:
    name = svc.metadata["name"]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(svc, f"{name}-{role}", role),
        "spec": {
            "replicas": count,
            "selector": {"matchLabels": {SERVICE_LABEL: name, ROLE_LABEL: role}},
            # Surge, never drop below the count: a new engine must load its model before an old one drains.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": pod_template(svc, role, inputs.buckets, config_hash(inputs.internal_token)),
        },
    }


def service(svc: LLMService, role: str) -> dict:
    name = svc.metadata["name"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(svc, f"{name}-{role}", role),
            "spec": {"selector": {SERVICE_LABEL: name, ROLE_LABEL: role},
                     "ports": [{"name": "http", "port": svc.spec.engine.port, "targetPort": "http"}]}}


def pdb(svc: LLMService) -> dict:
    name = svc.metadata["name"]
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(svc, name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {SERVICE_LABEL: name}}}}


def service_monitor(svc: LLMService) -> dict:
    name = svc.metadata["name"]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": _meta(svc, name),
            "spec": {"selector": {"matchLabels": {SERVICE_LABEL: name}},
                     "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}}


def desired(svc: LLMService, inputs: Inputs) -> list[dict]:
    """All children, in apply order (the ConfigMap and Secret before the pods that read them, the NetworkPolicies
    before the pods they guard)."""
    cm, owner = config_map(svc, inputs), owner_reference(svc)
    out = [cm, trust.secret(svc, owner, inputs.internal_token)]
    if inputs.network_policy:
        out += trust.network_policies(svc, owner, inputs.autoscaler_namespace)
    auto = svc.spec.autoscaling.enabled
    for role, pool in svc.spec.topology.pools().items():
        count = replicas(pool, auto, svc.status.autoscaling.get(role))
        out += [deployment(svc, role, count, inputs), service(svc, role)]
    if svc.spec.router.enabled:
        out += router.children(svc, owner, inputs.router_cluster_role, cm["metadata"]["name"],
                               config_hash(inputs.internal_token))
    out.append(pdb(svc))
    if inputs.service_monitor:
        out.append(service_monitor(svc))
    if inputs.inference_pool:
        out.append(gateway.inference_pool(svc, owner))
    return out
