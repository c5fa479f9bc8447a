"""The autoscaler's Kubernetes mode against the real API server, without engines: no metrics means a
MetricsStale hold that asks for nothing, and requests held by a router pod scale a role up from zero."""
from __future__ import annotations

import json
import time

from kubernetes import config

from slofleet.autoscaler.kube import Kube
from slofleet.autoscaler.kubemode import Autoscaler
from slofleet.autoscaler.policy import PolicyConfig
from tests.k8s.conftest import wait_until
from tests.k8s.test_operator import apply

# A stand-in for a router pod (run by the node runner): its /metrics holds 3 requests for want of a replica.
STAND_IN_ROUTER = """
import os
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'slofleet:router_held_requests{bucket="chat"} 2\\n'
                         b'slofleet:router_held_requests{bucket="doc"} 1\\n')
HTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()
"""


def entry(cluster, ns: str) -> dict:
    return cluster.get("llms", "idle", ns)["status"].get("autoscaling", {}).get("unified", {})


def events(cluster, ns: str) -> list[dict]:
    out = cluster.kubectl("get", "events", "-n", ns, "-o", "json", "--field-selector",
                          "involvedObject.name=idle,source=slofleet-autoscaler").stdout
    return sorted(json.loads(out)["items"], key=lambda e: e["metadata"]["creationTimestamp"])


def test_no_metrics_holds_and_held_router_requests_scale_from_zero(crds, namespace):
    # No operator runs here, so no engine pods ever appear: the role stays at zero replicas.
    apply(crds, namespace, "idle", {"topology": {"unified": {"minReplicas": 0, "maxReplicas": 2}},
                                    "autoscaling": {"enabled": True, "intervalSeconds": 1}})
    scaler = Autoscaler(Kube(config.new_client_from_config(crds.kubeconfig)), PolicyConfig(), namespace)

    scaler.tick()
    stale = entry(crds, namespace)
    assert stale["condition"] == "MetricsStale" and "desiredReplicas" not in stale  # nothing asked on no data
    assert [(e["type"], e["reason"]) for e in events(crds, namespace)] == [("Warning", "MetricsStale")]

    router = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "idle-router", "labels": {"slofleet.dev/service": "idle", "slofleet.dev/role": "router"}},
        "spec": {"containers": [{"name": "router", "image": "stand-in", "command": ["python3", "-c", STAND_IN_ROUTER],
                                 "ports": [{"name": "http", "containerPort": 8080}],
                                 "readinessProbe": {"httpGet": {"path": "/metrics", "port": "http"}}}]}}
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(router))
    wait_until("the stand-in router Ready", lambda: any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (crds.get("pod", "idle-router", namespace).get("status") or {}).get("conditions", [])), timeout=30)

    time.sleep(1.1)  # the service's interval
    scaler.tick()
    woke = entry(crds, namespace)
    assert woke["desiredReplicas"] == 1 and woke["condition"] == "Ok"
    assert woke["reason"] == "scale from zero to 1: the router holds 3 requests"
    ev = events(crds, namespace)[-1]
    assert (ev["reason"], ev["message"]) == ("ScaledUp", f"unified: 0 -> 1: {woke['reason']}")

    # Still no engine metrics: the last decision is held (and said so), never dropped back to zero.
    time.sleep(1.1)
    scaler.tick()
    held = entry(crds, namespace)
    assert (held["desiredReplicas"], held["condition"]) == (1, "MetricsStale")
    assert events(crds, namespace)[-1]["reason"] == "MetricsStale"
