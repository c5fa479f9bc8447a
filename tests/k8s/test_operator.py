"""The operator against the real API server: children, ownership and garbage collection, drift repair,
rollout, status from real (node-runner) pods, the autoscaler contract, and a restart mid-way."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.k8s.conftest import REPO, engine_auth, free_ports, log, use_real_cli, wait_until

UNIFIED = {"engine": {"resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                      "drainSeconds": 5, "maxNumSeqs": 8},
           "topology": {"unified": {"minReplicas": 1, "maxReplicas": 3, "replicas": 1}},
           "buckets": [{"name": "chat", "priority": 0, "slo": {"ttftMs": 500}},
                       {"name": "doc", "priority": 5, "slo": {"percentile": 90, "e2eMs": 20000}}]}
DISAGG = {"engine": UNIFIED["engine"], "policyRef": "standard",
          "topology": {"mode": "disaggregated", "prefill": {"minReplicas": 1, "maxReplicas": 2},
                       "decode": {"minReplicas": 1, "maxReplicas": 2}}}


class Operator:
    """`slofleet operator` as a process, watching one namespace."""

    def __init__(self, cluster, namespace: str):
        self.cluster, self.namespace, self.proc = cluster, namespace, None
        self.metrics_port = free_ports(1)
        logs = REPO / ".pytest_cache" / "k8s"  # kept after the run for a look when a test failed
        logs.mkdir(parents=True, exist_ok=True)
        self.log = open(logs / f"operator-{namespace}.log", "ab")

    def start(self) -> None:
        cmd = [sys.executable, "-m", "slofleet.cli", "operator", "--standalone", "--namespace", self.namespace,
               "--metrics-port", str(self.metrics_port), "--health-port", "0", "--resync-seconds", "3"]
        self.proc = subprocess.Popen(cmd, env=self.cluster.env, stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        self.stop()
        self.log.close()


@pytest.fixture
def operator(crds, namespace):
    op = Operator(crds, namespace)
    op.start()
    yield op
    # Delete what the test left while the operator still runs to lift kopf's finalizer: a resource stuck on it
    # holds its namespace open and, later, any deletion of the CRD (test_install's `kubectl delete -k`).
    crds.kubectl("delete", "llms", "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False)
    op.close()


def apply(cluster, ns: str, name: str, spec: dict) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(
        {"apiVersion": "slofleet.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name}, "spec": spec}))


def children(cluster, ns: str, name: str) -> dict[str, dict]:
    out = {}
    for kind in ("deployment", "service", "configmap", "poddisruptionbudget", "serviceaccount", "rolebinding"):
        for o in cluster.items(kind, ns, f"slofleet.dev/service={name}"):
            out[f"{o['kind']}/{o['metadata']['name']}"] = o
    return out


def router_children(name: str) -> set[str]:
    return {f"{kind}/{name}-router" for kind in ("Deployment", "Service", "ServiceAccount", "RoleBinding")}


def condition(obj: dict, type_: str) -> str | None:
    return next((c["status"] for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), None)


def test_unified_service_lifecycle(crds, namespace, operator):
    t0 = time.monotonic()
    apply(crds, namespace, "chat", UNIFIED)
    want = {"ConfigMap/chat-engine", "Deployment/chat-unified", "Service/chat-unified", "PodDisruptionBudget/chat",
            *router_children("chat")}
    objs = wait_until("the children", lambda: (c := children(crds, namespace, "chat")) and set(c) == want and c)
    uid = crds.get("llms", "chat", namespace)["metadata"]["uid"]
    for o in objs.values():
        assert [(r["kind"], r["uid"], r["controller"]) for r in o["metadata"]["ownerReferences"]] == \
            [("LLMService", uid, True)]
    args = objs["Deployment/chat-unified"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--bucket-priorities" not in args  # the router gives each request its bucket's priority
    policy = json.loads(objs["ConfigMap/chat-engine"]["data"]["policy.json"])
    assert [(b["name"], b["priority"]) for b in policy["buckets"]] == [("chat", 0), ("doc", 5)]
    log(f"  children created: {time.monotonic() - t0:.1f}s")

    if crds.local:  # pods run on the test-only node runner, so the service goes Ready
        got = wait_until("Ready=True", lambda: (s := crds.get("llms", "chat", namespace)) and
                         condition(s, "Ready") == "True" and s, timeout=90)
        assert got["status"]["roles"]["unified"] == {"replicas": 1, "readyReplicas": 1, "desiredReplicas": 1}
        assert got["status"]["roles"]["router"] == {"replicas": 1, "readyReplicas": 1, "desiredReplicas": 1}
        assert got["status"]["endpoint"] == f"http://chat-router.{namespace}.svc:8080"
        assert got["status"]["observedGeneration"] == got["metadata"]["generation"]
        pod = crds.items("pods", namespace, "slofleet.dev/service=chat,slofleet.dev/role=unified")[0]
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/argv", timeout=5) as r:
            assert json.loads(r.read())[:3] == ["serve", "--host", pod["status"]["podIP"]]
        pod = crds.items("pods", namespace, "slofleet.dev/service=chat,slofleet.dev/role=router")[0]
        assert pod["spec"]["serviceAccountName"] == "chat-router"
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/argv", timeout=5) as r:
            argv = json.loads(r.read())
            assert argv[0] == "router" and argv[argv.index("--k8s-llmservice") + 1] == f"{namespace}/chat"
        log(f"  Ready: {time.monotonic() - t0:.1f}s")
    events = crds.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=chat").stdout
    assert "Created" in events
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'slofleet_operator_child_changes_total{action="created",kind="Deployment"} 2.0' in metrics  # engines, router
    assert "slofleet_operator_reconcile_duration_seconds_count" in metrics

    # Idempotent: resyncs (every 3 s) leave the children untouched.
    versions = {k: o["metadata"]["resourceVersion"] for k, o in children(crds, namespace, "chat").items()
                if not k.startswith("Deployment")}  # a Deployment's own status moves its version
    gen = crds.get("deployment", "chat-unified", namespace)["metadata"]["generation"]
    time.sleep(7)
    assert {k: o["metadata"]["resourceVersion"] for k, o in children(crds, namespace, "chat").items()
            if not k.startswith("Deployment")} == versions
    assert crds.get("deployment", "chat-unified", namespace)["metadata"]["generation"] == gen

    # Drift repair: a deleted child comes back, an edited one is put right.
    crds.kubectl("delete", "service", "chat-unified", "-n", namespace)
    wait_until("the Service back", lambda: crds.get("service", "chat-unified", namespace), timeout=30)
    crds.kubectl("scale", "deployment", "chat-unified", "-n", namespace, "--replicas=3")
    wait_until("replicas restored", lambda: crds.get("deployment", "chat-unified", namespace)["spec"]["replicas"] == 1,
               timeout=30)
    log(f"  drift repaired: {time.monotonic() - t0:.1f}s")

    # A spec change rolls out.
    apply(crds, namespace, "chat", {**UNIFIED, "engine": {**UNIFIED["engine"], "maxNumSeqs": 16}})
    def rolled():
        c = crds.get("deployment", "chat-unified", namespace)["spec"]["template"]["spec"]["containers"][0]
        return c["args"][c["args"].index("--max-num-seqs") + 1] == "16"
    wait_until("the new args in the Deployment", rolled, timeout=30)
    if crds.local:
        wait_until("the rollout done and Ready", lambda: (s := crds.get("llms", "chat", namespace)) and
                   condition(s, "Ready") == "True" and condition(s, "Progressing") == "False", timeout=90)
    log(f"  rolled out: {time.monotonic() - t0:.1f}s")

    # One writer per field: the autoscaler's decision (in status) is clamped to the bounds.
    crds.kubectl("patch", "llms", "chat", "-n", namespace, "--type=merge", "-p",
                 json.dumps({"spec": {"autoscaling": {"enabled": True}}}))
    crds.kubectl("patch", "llms", "chat", "-n", namespace, "--subresource=status", "--type=merge", "-p",
                 json.dumps({"status": {"autoscaling": {"unified": {"desiredReplicas": 9, "reason": "test"}}}}))
    wait_until("replicas clamped to 3",
               lambda: crds.get("deployment", "chat-unified", namespace)["spec"]["replicas"] == 3,
               timeout=30)
    assert crds.get("llms", "chat", namespace)["status"]["autoscaling"]["unified"]["desiredReplicas"] == 9
    log(f"  autoscaler decision clamped: {time.monotonic() - t0:.1f}s")

    # Deleting the resource garbage-collects every child.
    crds.kubectl("delete", "llms", "chat", "-n", namespace)
    wait_until("children collected", lambda: not children(crds, namespace, "chat"), timeout=60)
    log(f"  garbage collected: {time.monotonic() - t0:.1f}s")


def test_disaggregated_service_and_operator_restart(crds, namespace, operator):
    t0 = time.monotonic()
    crds.kubectl("apply", "-n", namespace, "-f", str(REPO / "manifests" / "examples" / "slopolicy.yaml"))
    operator.stop(signal.SIGKILL)  # the operator dies before it sees the resource...
    apply(crds, namespace, "docs", DISAGG)
    operator.start()
    time.sleep(1.5)
    operator.stop(signal.SIGKILL)  # ...and again mid-way through reconciling it
    operator.start()
    want = {"ConfigMap/docs-engine", "Deployment/docs-prefill", "Deployment/docs-decode", "Service/docs-prefill",
            "Service/docs-decode", "PodDisruptionBudget/docs", *router_children("docs")}
    objs = wait_until("the disaggregated children", lambda: (c := children(crds, namespace, "docs")) and
                      set(c) == want and c, timeout=60)
    policy = json.loads(objs["ConfigMap/docs-engine"]["data"]["policy.json"])
    assert [b["name"] for b in policy["buckets"]] == ["chat", "agent"]  # from the SLOPolicy
    for role in ("prefill", "decode"):
        args = objs[f"Deployment/docs-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--role") + 1] == role
    # Exactly one of each: after the restarts, and after a few resyncs more.
    time.sleep(4)
    assert set(children(crds, namespace, "docs")) == want
    assert len(crds.items("replicasets", namespace, "slofleet.dev/service=docs")) == 3
    if crds.local:
        wait_until("Ready=True", lambda: condition(crds.get("llms", "docs", namespace), "Ready") == "True", timeout=90)
        assert len(crds.items("pods", namespace, "slofleet.dev/service=docs")) == 3
        # The engines' EndpointSlices carry their Service's role label: what the router discovers them by.
        slices = crds.items("endpointslices", namespace,
                            "slofleet.dev/service=docs,slofleet.dev/role in (unified,prefill,decode)")
        assert sorted(s["metadata"]["labels"]["slofleet.dev/role"] for s in slices) == ["decode", "prefill"]
    # Back to unified: the prefill/decode children are pruned, the unified ones appear.
    apply(crds, namespace, "docs", {**UNIFIED, "policyRef": "standard"})
    want_unified = {"ConfigMap/docs-engine", "Deployment/docs-unified", "Service/docs-unified",
                    "PodDisruptionBudget/docs", *router_children("docs")}
    wait_until("the topology switched", lambda: set(children(crds, namespace, "docs")) == want_unified, timeout=60)
    wait_until("status roles switched",
               lambda: set(crds.get("llms", "docs", namespace)["status"].get("roles", {})) == {"unified", "router"},
               timeout=30)
    log(f"  disaggregated + restarts: {time.monotonic() - t0:.1f}s")


@pytest.mark.slow
def test_real_engine_pod_serves(crds, namespace, operator):
    """One pod running the real `slofleet serve` (the embedded model, ~1 GB, ~10-30 s to load) behind the
    operator: Ready only once the model answers, and the OpenAI API answers at the pod's IP."""
    if not crds.local:
        pytest.skip("needs the test-only node runner (pods run the image elsewhere)")
    t0 = time.monotonic()
    use_real_cli(crds, namespace)
    spec = {"engine": {**UNIFIED["engine"], "kvCacheMemoryGb": 0.25, "maxModelLen": 2048},
            "topology": {"unified": {"replicas": 1}}, "buckets": UNIFIED["buckets"],
            "router": {"enabled": False}}  # the engine alone
    apply(crds, namespace, "real", spec)
    wait_until("Ready=True", lambda: condition(crds.get("llms", "real", namespace), "Ready") == "True", timeout=240)
    pod = crds.items("pods", namespace, "slofleet.dev/service=real")[0]
    ask = urllib.request.Request(f"http://{pod['status']['podIP']}:8000/v1/models",
                                 headers=engine_auth(crds, namespace, "real"))
    with urllib.request.urlopen(ask, timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"]
    log(f"  real engine Ready and serving: {time.monotonic() - t0:.1f}s")
    crds.kubectl("delete", "llms", "real", "-n", namespace)
    wait_until("the engine pod gone", lambda: not crds.items("pods", namespace, "slofleet.dev/service=real"),
               timeout=60)


@pytest.fixture
def servicemonitor_crd(crds):
    """A stand-in for the Prometheus operator's ServiceMonitor CRD (schema-less), present before the operator starts."""
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
           "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                    "names": {"kind": "ServiceMonitor", "plural": "servicemonitors", "singular": "servicemonitor"},
                    "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
    crds.kubectl("apply", "-f", "-", input=json.dumps(crd))
    crds.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/servicemonitors.monitoring.coreos.com")
    yield
    crds.kubectl("delete", "crd", "servicemonitors.monitoring.coreos.com", "--wait=false")


def test_service_monitor_when_its_crd_exists(crds, namespace, servicemonitor_crd, operator):
    apply(crds, namespace, "mon", UNIFIED)
    sm = wait_until("the ServiceMonitor", lambda: crds.get("servicemonitor", "mon", namespace), timeout=30)
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert sm["metadata"]["ownerReferences"][0]["kind"] == "LLMService"
