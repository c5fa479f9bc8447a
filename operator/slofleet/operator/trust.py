"""Pure: the trust boundary of one LLMService (ARCHITECTURE.md): the Secret with its internal token, and the
NetworkPolicies that let only the service's own router, its engines, the autoscaler and a named gateway reach the
engines, while the router, the endpoint, takes requests from anywhere.

The token itself is drawn in reconcile.py (the one effectful place), once, and read back from the Secret after:
`desired()` stays a function of its inputs.
"""
from __future__ import annotations

import base64

from slofleet.api.contract import (
    INTERNAL_TOKEN_KEY,
    KV_EVENTS_PORT_NAME,
    KV_REPLAY_PORT_NAME,
    ROLE_LABEL,
    ROLES,
    ROUTER,
    SERVICE_LABEL,
)
from slofleet.api.v1alpha1 import LLMService
from slofleet.operator import router
from slofleet.operator.podspec import labels, secret_name

# Where the autoscaler runs (the operator's namespace in manifests/ and the chart) and its pods' label: it scrapes
# each engine's /metrics. The operator's pods, beside it, read an engine's in-flight work and drain it before a
# scale-down removes it (drain.py).
AUTOSCALER_NAMESPACE = "slofleet-system"
AUTOSCALER_LABELS = {"app.kubernetes.io/name": "slofleet-autoscaler"}
OPERATOR_LABELS = {"app.kubernetes.io/name": "slofleet-operator"}
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server


def secret(svc: LLMService, owner: dict, token: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": secret_name(svc), "namespace": svc.metadata.get("namespace", "default"),
                         "labels": labels(svc.metadata["name"]), "ownerReferences": [owner]},
            "data": {INTERNAL_TOKEN_KEY: base64.b64encode(token.encode()).decode()}}


def token_of(existing: dict | None) -> str | None:
    """The token an existing Secret holds; None when there is none yet (or it was emptied)."""
    data = ((existing or {}).get("data") or {}).get(INTERNAL_TOKEN_KEY)
    return base64.b64decode(data).decode() if data else None


def _in(namespace: str) -> dict:
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: namespace}}}


def engine_selector(svc: LLMService) -> dict:
    return {"matchLabels": {SERVICE_LABEL: svc.metadata["name"]},
            "matchExpressions": [{"key": ROLE_LABEL, "operator": "In", "values": list(ROLES)}]}


def network_policies(svc: LLMService, owner: dict, autoscaler_namespace: str) -> list[dict]:
    """The engines' NetworkPolicy, and the router's when it is on."""
    name, ns = svc.metadata["name"], svc.metadata.get("namespace", "default")
    routers = {"podSelector": {"matchLabels": {SERVICE_LABEL: name, ROLE_LABEL: ROUTER}}}
    # Peers: the decode engines pull KV from the prefill ones. Pod selectors alone mean this namespace.
    peers = [routers, {"podSelector": engine_selector(svc)},
             {**_in(autoscaler_namespace), "podSelector": {"matchLabels": AUTOSCALER_LABELS}},
             {**_in(autoscaler_namespace), "podSelector": {"matchLabels": OPERATOR_LABELS}}]
    if svc.spec.network.gateway_namespace:
        peers.append(_in(svc.spec.network.gateway_namespace))

    def rule(ports: list[int | str], sources: list[dict] | None) -> dict:
        return {"ports": [{"protocol": "TCP", "port": p} for p in ports], **({"from": sources} if sources else {})}

    def policy(meta_name: str, meta_labels: dict, pods: dict, rules: list[dict]) -> dict:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": meta_name, "namespace": ns, "labels": meta_labels, "ownerReferences": [owner]},
                "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": rules}}

    engine_rules = [rule([svc.spec.engine.port], peers)]
    if svc.spec.router.kv_events():  # the engines' KV events (named container ports) are the router's alone
        engine_rules.append(rule([KV_EVENTS_PORT_NAME, KV_REPLAY_PORT_NAME], [routers]))
    out = [policy(f"{name}-engine", labels(name), engine_selector(svc), engine_rules)]
    if svc.spec.router.enabled:  # no `from`: any source, so the endpoint stays open under a namespace's default deny
        out.append(policy(router.name_of(svc), router.router_labels(svc), routers["podSelector"],
                          [rule([svc.spec.router.port], None)]))
    return out
