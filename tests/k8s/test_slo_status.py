"""Per-bucket SLO attainment in status, against the real API server: the autoscaler (autoscaling off) reads a
stand-in engine pod's histograms and writes status.buckets under its own field manager, the operator's reconcile
derives SLOMet from them without either clobbering the other's fields, and `kubectl get llms` shows the worst
attainment. A pod that crash-loops makes Degraded True."""
from __future__ import annotations

import json

from kubernetes import config, dynamic

from slofleet.api.contract import E2E, TTFT
from slofleet.autoscaler.kube import FIELD_MANAGER, Kube
from slofleet.autoscaler.kubemode import Autoscaler
from slofleet.autoscaler.policy import PolicyConfig
from slofleet.operator import kube as operator_kube
from slofleet.operator.reconcile import reconcile
from tests.k8s.conftest import wait_until
from tests.k8s.test_operator import apply

BOUNDS = ("0.005", "0.01", "0.02", "0.04", "0.1", "+Inf")


def lines(name: str, bucket: str, counts: tuple[int, ...]) -> list[str]:
    return [f'{name}_bucket{{bucket="{bucket}",le="{le}",model_name="m"}} {c}' for le, c in zip(BOUNDS, counts)]


# What an engine that served 4 chat requests (TTFT 10-100 ms) and 3 strict ones (TTFT under 20 ms, one under 5 ms)
# answers on /metrics, served by a stand-in pod the node runner runs.
METRICS = "\n".join([*lines(TTFT, "chat", (0, 0, 1, 3, 4, 4)), *lines(E2E, "chat", (0, 0, 0, 0, 0, 4)),
                     *lines(TTFT, "strict", (1, 2, 3, 3, 3, 3)), *lines(E2E, "strict", (0, 0, 0, 0, 3, 3))]) + "\n"
STAND_IN_ENGINE = f"""
import os
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write({METRICS.encode()!r})
HTTPServer((os.environ["POD_IP"], 8000), H).serve_forever()
"""
SPEC = {"topology": {"unified": {"minReplicas": 0, "maxReplicas": 1, "replicas": 0}}, "router": {"enabled": False},
        "buckets": [{"name": "chat", "slo": {"ttftMs": 1000}},
                    {"name": "strict", "match": {"header": {"x-tier": "strict"}}, "slo": {"ttftMs": 1}}]}


def stand_in_pod(cluster, ns: str, service: str, name: str, script: str, probe: bool = True) -> None:
    container = {"name": "engine", "image": "stand-in", "command": ["python3", "-c", script],
                 "ports": [{"name": "http", "containerPort": 8000}]}
    if probe:
        container["readinessProbe"] = {"httpGet": {"path": "/metrics", "port": "http"}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "labels": {"slofleet.dev/service": service, "slofleet.dev/role": "unified"}},
        "spec": {"containers": [container]}}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pod))


def conditions(cluster, ns: str, name: str) -> dict[str, dict]:
    return {c["type"]: c for c in cluster.get("llms", name, ns)["status"].get("conditions", [])}


def test_the_autoscaler_writes_bucket_attainment_and_the_operator_slo_met(crds, namespace):
    apply(crds, namespace, "slo", SPEC)
    stand_in_pod(crds, namespace, "slo", "slo-engine", STAND_IN_ENGINE)
    wait_until("the stand-in engine Ready", lambda: any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (crds.get("pod", "slo-engine", namespace).get("status") or {}).get("conditions", [])), timeout=30)
    api = config.new_client_from_config(crds.kubeconfig)

    Autoscaler(Kube(api), PolicyConfig(), namespace).tick()
    st = crds.get("llms", "slo", namespace)["status"]
    got = {b["name"]: b for b in st["buckets"]}
    assert (got["chat"]["requests"], got["chat"]["attainment"], got["chat"]["met"]) == (4, 1.0, True)
    assert got["strict"]["requests"] == 3 and got["strict"]["attainment"] < 0.5 and got["strict"]["met"] is False
    assert got["strict"]["windowSeconds"] == 300 and got["strict"]["percentile"] == 99 and got["strict"]["ttftMs"] > 1
    assert st["attainment"] == got["strict"]["attainment"]
    assert not st["autoscaling"]  # autoscaling is off: no decision, but the buckets all the same

    reconcile(operator_kube.Kube(dynamic.DynamicClient(api)), crds.get("llms", "slo", namespace))
    slo = conditions(crds, namespace, "slo")["SLOMet"]
    assert (slo["status"], slo["reason"]) == ("False", "BucketMissed") and "bucket strict" in slo["message"]
    assert conditions(crds, namespace, "slo")["Degraded"]["status"] == "False"
    assert crds.get("llms", "slo", namespace)["status"]["buckets"] == st["buckets"]  # the operator left them

    Autoscaler(Kube(api), PolicyConfig(), namespace).tick()  # a restarted autoscaler writes again
    assert conditions(crds, namespace, "slo")["SLOMet"]["status"] == "False"  # the autoscaler left the conditions
    shown = crds.kubectl("get", "llms", "slo", "-n", namespace, "-o", "json", "--show-managed-fields")
    after = json.loads(shown.stdout)
    mine = [m for m in after["metadata"]["managedFields"] if m["manager"] == FIELD_MANAGER]
    assert mine and all(m["subresource"] == "status" for m in mine)
    owned = json.dumps([m["fieldsV1"] for m in mine])
    assert "f:buckets" in owned and "f:attainment" in owned and "f:conditions" not in owned

    out = crds.kubectl("get", "llms", "slo", "-n", namespace).stdout.splitlines()
    header, row = out[0].split(), out[1].split()
    assert header == ["NAME", "MODE", "MODEL", "READY", "ATTAINMENT", "AGE"]
    assert float(row[header.index("ATTAINMENT")]) == st["attainment"]


def test_a_crash_looping_pod_makes_the_service_degraded(crds, namespace):
    apply(crds, namespace, "crashy", {**SPEC, "buckets": []})
    stand_in_pod(crds, namespace, "crashy", "crashy-engine", "import sys; sys.exit(3)", probe=False)
    kube = operator_kube.Kube(dynamic.DynamicClient(config.new_client_from_config(crds.kubeconfig)))

    def degraded():
        reconcile(kube, crds.get("llms", "crashy", namespace))
        d = conditions(crds, namespace, "crashy")["Degraded"]
        return d if d["status"] == "True" else None

    d = wait_until("Degraded True", degraded, timeout=60, interval=1)
    assert d["reason"] == "PodsFailing"
    assert d["message"].startswith("unified: pod crashy-engine: container engine CrashLoopBackOff"), d["message"]
