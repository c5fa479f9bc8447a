"""The trust boundary against the real API server: the operator gives each LLMService an internal token Secret
(created once, kept across reconciles), puts it in every engine and router pod's env, guards the engines with a
NetworkPolicy, and all of it goes with the resource (garbage collection, kube-controller-manager)."""
from __future__ import annotations

import base64
import time

from slofleet.api.contract import INTERNAL_TOKEN_ENV
from tests.k8s.conftest import log, wait_until
from tests.k8s.test_operator import UNIFIED, apply, operator  # noqa: F401 (operator: the fixture)

SPEC = {**UNIFIED, "topology": {"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        "network": {"gatewayNamespace": "gw"}}
DEPLOYMENTS = ("guard-prefill", "guard-decode", "guard-router")
ENGINES = "slofleet.dev/service=guard,slofleet.dev/role in (unified,prefill,decode)"


def token(crds, ns: str) -> str:
    return base64.b64decode(crds.get("secret", "guard-internal-token", ns)["data"]["token"]).decode()


def template(crds, ns: str, name: str) -> dict:
    return crds.get("deployment", name, ns)["spec"]["template"]


def test_token_secret_env_and_network_policies(crds, namespace, operator):  # noqa: F811
    t0, ns = time.monotonic(), namespace
    apply(crds, ns, "guard", SPEC)
    wait_until("the Secret, NetworkPolicies and Deployments", lambda: crds.get("secret", "guard-internal-token", ns)
               and len(crds.items("networkpolicy", ns, "slofleet.dev/service=guard")) == 2
               and all(crds.get("deployment", d, ns) for d in DEPLOYMENTS), timeout=60)
    uid = crds.get("llms", "guard", ns)["metadata"]["uid"]
    secret = crds.get("secret", "guard-internal-token", ns)
    policies = {p["metadata"]["name"]: p for p in crds.items("networkpolicy", ns, "slofleet.dev/service=guard")}
    for o in (secret, *policies.values()):
        assert [(r["kind"], r["uid"], r["controller"]) for r in o["metadata"]["ownerReferences"]] == \
            [("LLMService", uid, True)]
    first = token(crds, ns)
    assert len(first) >= 32

    ref = {"name": INTERNAL_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "guard-internal-token", "key": "token"}}}
    for d in DEPLOYMENTS:
        assert ref in template(crds, ns, d)["spec"]["containers"][0]["env"], d

    engine, router = policies["guard-engine"]["spec"], policies["guard-router"]["spec"]
    assert engine["policyTypes"] == ["Ingress"] and router["policyTypes"] == ["Ingress"]
    assert engine["podSelector"] == {"matchLabels": {"slofleet.dev/service": "guard"}, "matchExpressions": [
        {"key": "slofleet.dev/role", "operator": "In", "values": ["unified", "prefill", "decode"]}]}
    [rule] = engine["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"slofleet.dev/service": "guard", "slofleet.dev/role": "router"}}},
        {"podSelector": engine["podSelector"]},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "slofleet-system"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "slofleet-autoscaler"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "slofleet-system"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "slofleet-operator"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}]
    assert router == {"podSelector": {"matchLabels": {"slofleet.dev/service": "guard", "slofleet.dev/role": "router"}},
                      "policyTypes": ["Ingress"], "ingress": [{"ports": [{"protocol": "TCP", "port": 8080}]}]}
    # The engine policy's selector, asked of the API server, finds the engine Deployments' pods and not the router's.
    if crds.local:
        wait_until("the pods", lambda: len(crds.items("pods", ns, "slofleet.dev/service=guard")) == 3, timeout=60)
        assert sorted(p["metadata"]["labels"]["slofleet.dev/role"] for p in crds.items("pods", ns, ENGINES)) == \
            ["decode", "prefill"]
    log(f"  token, env, policies: {time.monotonic() - t0:.1f}s")

    # A spec change reconciles everything again; the token stays.
    apply(crds, ns, "guard", {**SPEC, "engine": {**SPEC["engine"], "maxNumSeqs": 16}})
    def rolled():
        args = template(crds, ns, "guard-decode")["spec"]["containers"][0]["args"]
        return args[args.index("--max-num-seqs") + 1] == "16"
    wait_until("the new args", rolled, timeout=30)
    time.sleep(4)  # and a resync (every 3 s) more
    assert token(crds, ns) == first

    # A deleted Secret comes back with a new token, and every pod template rolls onto it.
    hashes = {d: template(crds, ns, d)["metadata"]["annotations"]["slofleet.dev/config-hash"] for d in DEPLOYMENTS}
    crds.kubectl("delete", "secret", "guard-internal-token", "-n", ns)
    wait_until("a new token", lambda: crds.get("secret", "guard-internal-token", ns) and token(crds, ns) != first,
               timeout=30)
    wait_until("the pods rolled", lambda: all(
        template(crds, ns, d)["metadata"]["annotations"]["slofleet.dev/config-hash"] != hashes[d] for d in DEPLOYMENTS),
        timeout=30)
    log(f"  token kept, and renewed: {time.monotonic() - t0:.1f}s")

    crds.kubectl("delete", "llms", "guard", "-n", ns)
    wait_until("the Secret and NetworkPolicies collected", lambda: not any(
        crds.items(kind, ns, "slofleet.dev/service=guard") for kind in ("secret", "networkpolicy")), timeout=60)
    log(f"  garbage collected: {time.monotonic() - t0:.1f}s")
