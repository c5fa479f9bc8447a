"""The trust boundary's pure builders: the internal token's Secret, its env on every engine and router pod, and the
NetworkPolicies that let only the service's router, engines, the autoscaler and a named gateway reach the engines."""
from __future__ import annotations

import base64

import pytest
from pydantic import ValidationError

from slofleet.api.contract import INTERNAL_TOKEN_ENV
from slofleet.api.v1alpha1 import LLMService
from slofleet.operator import children, trust

DISAGG = {"mode": "disaggregated", "prefill": {}, "decode": {}}
OWNER = [{"apiVersion": "slofleet.dev/v1alpha1", "kind": "LLMService", "name": "s", "uid": "uid-1",
          "controller": True, "blockOwnerDeletion": True}]
TOKEN_ENV = {"name": INTERNAL_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "s-internal-token", "key": "token"}}}


def svc(spec: dict | None = None) -> LLMService:
    return LLMService.model_validate({"metadata": {"name": "s", "namespace": "ns", "uid": "uid-1"}, "spec": spec or {}})


def build(s: LLMService, token: str = "tok-1", **inputs) -> dict[str, dict]:
    objs = children.desired(s, children.Inputs(buckets=[], internal_token=token, **inputs))
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def containers(objs: dict) -> dict[str, dict]:
    return {k: o["spec"]["template"]["spec"]["containers"][0] for k, o in objs.items() if k.startswith("Deployment/")}


def test_the_secret_holds_the_given_token_and_is_owned_by_the_service():
    objs = build(svc(), token="s3cr3t")
    sec = objs["Secret/s-internal-token"]
    assert sec["data"] == {"token": base64.b64encode(b"s3cr3t").decode()} and sec["type"] == "Opaque"
    assert sec["metadata"]["ownerReferences"] == OWNER
    assert sec["metadata"]["labels"]["slofleet.dev/service"] == "s"
    assert trust.token_of(sec) == "s3cr3t"
    assert trust.token_of(None) is None and trust.token_of({"data": {}}) is None
    # Before every pod that reads it.
    kinds = [o["kind"] for o in children.desired(svc(), children.Inputs(buckets=[], internal_token="t"))]
    assert kinds.index("Secret") < kinds.index("Deployment")


@pytest.mark.parametrize("topology", [{}, DISAGG])
def test_every_engine_and_router_container_reads_the_token_from_the_secret(topology):
    got = containers(build(svc({"topology": topology, "engine": {"env": {INTERNAL_TOKEN_ENV: "in-the-spec"}}})))
    want = {"Deployment/s-router", *(["Deployment/s-unified"] if not topology else
                                     ["Deployment/s-prefill", "Deployment/s-decode"])}
    assert set(got) == want
    for c in got.values():
        # once, from the Secret: a value written in spec.engine.env never replaces it
        assert [e for e in c["env"] if e["name"] == INTERNAL_TOKEN_ENV] == [TOKEN_ENV]


def test_a_new_token_rolls_every_pod():
    def hashes(token: str) -> dict[str, str]:
        return {k: o["spec"]["template"]["metadata"]["annotations"]["slofleet.dev/config-hash"]
                for k, o in build(svc({"topology": DISAGG}), token=token).items() if k.startswith("Deployment/")}

    a, b = hashes("one"), hashes("two")
    assert len(a) == 3 and all(a[k] != b[k] for k in a)
    assert hashes("one") == a


def test_no_network_policy_unless_the_api_server_serves_them():
    assert not [k for k in build(svc()) if k.startswith("NetworkPolicy/")]


def test_engines_take_ingress_only_from_the_router_their_peers_the_autoscaler_and_the_operator():
    objs = build(svc({"topology": DISAGG, "engine": {"port": 8123}}), network_policy=True)
    assert sorted(k for k in objs if k.startswith("NetworkPolicy/")) == ["NetworkPolicy/s-engine",
                                                                          "NetworkPolicy/s-router"]
    engines = {"matchLabels": {"slofleet.dev/service": "s"},
               "matchExpressions": [{"key": "slofleet.dev/role", "operator": "In",
                                     "values": ["unified", "prefill", "decode"]}]}
    pol = objs["NetworkPolicy/s-engine"]
    assert pol["metadata"]["ownerReferences"] == OWNER and pol["metadata"]["namespace"] == "ns"
    assert pol["spec"] == {
        "podSelector": engines, "policyTypes": ["Ingress"],
        "ingress": [{"ports": [{"protocol": "TCP", "port": 8123}], "from": [
            {"podSelector": {"matchLabels": {"slofleet.dev/service": "s", "slofleet.dev/role": "router"}}},
            {"podSelector": engines},
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "slofleet-system"}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "slofleet-autoscaler"}}},
            # the operator reads in-flight work and drains an engine before a scale-down removes it
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "slofleet-system"}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "slofleet-operator"}}}]}]}
    # The policy selects exactly the pods of every engine Deployment, and not the router's.
    for role in ("prefill", "decode"):
        pod_labels = objs[f"Deployment/s-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert pod_labels["slofleet.dev/service"] == "s" and pod_labels["slofleet.dev/role"] in \
            engines["matchExpressions"][0]["values"]
    assert objs["Deployment/s-router"]["spec"]["template"]["metadata"]["labels"]["slofleet.dev/role"] not in \
        engines["matchExpressions"][0]["values"]


def test_the_router_takes_requests_from_anywhere_on_its_port():
    objs = build(svc({"router": {"port": 9090}}), network_policy=True)
    pol = objs["NetworkPolicy/s-router"]
    assert pol["spec"] == {"podSelector": {"matchLabels": {"slofleet.dev/service": "s", "slofleet.dev/role": "router"}},
                           "policyTypes": ["Ingress"], "ingress": [{"ports": [{"protocol": "TCP", "port": 9090}]}]}
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= \
        objs["Deployment/s-router"]["spec"]["template"]["metadata"]["labels"].items()
    # No router: no policy for it, and nothing in the engines' for a router to be let in by (none runs).
    off = build(svc({"router": {"enabled": False}}), network_policy=True)
    assert [k for k in off if k.startswith("NetworkPolicy/")] == ["NetworkPolicy/s-engine"]


def test_a_gateway_namespace_and_the_autoscalers_namespace_are_let_in():
    objs = build(svc({"network": {"gatewayNamespace": "gw"}}), network_policy=True, autoscaler_namespace="ops")
    sources = objs["NetworkPolicy/s-engine"]["spec"]["ingress"][0]["from"]
    assert sources[2]["namespaceSelector"] == sources[3]["namespaceSelector"] == \
        {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}
    assert sources[4] == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}
    assert len(sources) == 5
    with pytest.raises(ValidationError, match="gatewayNamespace|gateway_namespace"):
        svc({"network": {"gatewayNamespace": "Not_A_Namespace"}})
