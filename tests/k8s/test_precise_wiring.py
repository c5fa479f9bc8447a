"""spec.router.policy precise against the real API server: the operator's engine pods publish KV events on named
ports that the engines' NetworkPolicy opens to the router alone, the router pod is told the engines' model and where
each replica publishes, and a router memory limit too small for the model is a Warning event on the resource."""
from __future__ import annotations

import json
import time
import urllib.request

from slofleet.api.contract import KV_EVENTS_PORT, KV_REPLAY_PORT
from tests.k8s.conftest import log, wait_until
from tests.k8s.test_operator import UNIFIED, apply, condition, operator  # noqa: F401 (operator: the fixture)

# The fake router (tests/k8s/fakebin) needs no memory; 256Mi is below what the real one needs for the model.
SPEC = {**UNIFIED, "router": {"policy": "precise", "resources": {"requests": {"cpu": "100m", "memory": "64Mi"},
                                                                  "limits": {"memory": "256Mi"}}}}


def argv(pod: dict, port: int) -> list[str]:
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:{port}/argv", timeout=5) as r:
        return json.loads(r.read())


def test_engines_publish_to_the_router_alone(crds, namespace, operator):  # noqa: F811
    t0, ns = time.monotonic(), namespace
    apply(crds, ns, "kv", SPEC)
    wait_until("the NetworkPolicies and Deployments", lambda: crds.get("networkpolicy", "kv-engine", ns)
               and crds.get("deployment", "kv-unified", ns) and crds.get("deployment", "kv-router", ns), timeout=60)
    # As stored by the API server: the named ports of the engine container, and the rule that admits the router.
    engine = crds.get("deployment", "kv-unified", ns)["spec"]["template"]["spec"]["containers"][0]
    assert [(p["name"], p["containerPort"]) for p in engine["ports"]] == \
        [("http", 8000), ("kv-events", KV_EVENTS_PORT), ("kv-replay", KV_REPLAY_PORT)]
    _, events_rule = crds.get("networkpolicy", "kv-engine", ns)["spec"]["ingress"]
    assert events_rule == {"ports": [{"protocol": "TCP", "port": name} for name in ("kv-events", "kv-replay")],
                           "from": [{"podSelector": {"matchLabels": {"slofleet.dev/service": "kv",
                                                                     "slofleet.dev/role": "router"}}}]}
    if crds.local:  # the pods run (the test-only node runner): what each process was started with
        wait_until("Ready=True", lambda: condition(crds.get("llms", "kv", ns), "Ready") == "True", timeout=90)
        pods = {p["metadata"]["labels"]["slofleet.dev/role"]: p
                for p in crds.items("pods", ns, "slofleet.dev/service=kv")}
        served, routed = argv(pods["unified"], 8000), argv(pods["router"], 8080)
        assert served[served.index("--kv-events-endpoint") + 1] == f"tcp://0.0.0.0:{KV_EVENTS_PORT}"
        assert served[served.index("--kv-events-replay-endpoint") + 1] == f"tcp://0.0.0.0:{KV_REPLAY_PORT}"
        assert routed[routed.index("--model") + 1] == served[served.index("--model") + 1] == "default"
        assert routed[routed.index("--kv-events-endpoint") + 1] == f"tcp://{{host}}:{KV_EVENTS_PORT}"
    wait_until("the memory warning", lambda: "RouterMemoryLow" in crds.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=kv").stdout, timeout=30)
    log(f"  precise wiring: {time.monotonic() - t0:.1f}s")
