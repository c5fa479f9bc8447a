"""Control plane faults on the local cluster: the operator SIGKILLed at random points of its reconciles under a spec
change converges to the same children, one of each, all owned by the LLMService; the autoscaler SIGKILLed
mid-decision leaves the replicas as they were; the API server stopped (SIGSTOP: calls hang, as in a partition)
leaves serving untouched, and everything resumes when it returns.

The CI version kills the operator 5 times and stops the API server for 10 s; `benchmarks/chaos.py --control-plane`
runs the long one (20 kills, 60 s) through the SLOFLEET_CHAOS_REPEATS and SLOFLEET_CHAOS_OUTAGE variables. In
tests/k8s, not tests/faults, to share the session's one cluster."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.k8s.conftest import REPO, log, wait_until
from tests.k8s.test_operator import UNIFIED, Operator, apply, children, condition, router_children
from tests.support.router import RouterProc

REPEATS = int(os.environ.get("SLOFLEET_CHAOS_REPEATS", "5"))
OUTAGE = float(os.environ.get("SLOFLEET_CHAOS_OUTAGE", "10"))
WANT = {"ConfigMap/chat-engine", "Deployment/chat-unified", "Service/chat-unified", "PodDisruptionBudget/chat",
        *router_children("chat")}


def spec(seqs: int) -> dict:
    return {**UNIFIED, "engine": {**UNIFIED["engine"], "maxNumSeqs": seqs}}


def engine_seqs(cluster, ns: str) -> str | None:
    d = cluster.get("deployment", "chat-unified", ns)
    args = d["spec"]["template"]["spec"]["containers"][0]["args"] if d else []
    return args[args.index("--max-num-seqs") + 1] if "--max-num-seqs" in args else None


def converged(cluster, ns: str, seqs: int) -> dict | None:
    objs = children(cluster, ns, "chat")
    live = [rs for rs in cluster.items("replicasets", ns, "slofleet.dev/service=chat") if rs["spec"]["replicas"]]
    ok = set(objs) == WANT and engine_seqs(cluster, ns) == str(seqs) and len(live) == 2  # engines' and router's
    return objs if ok else None


def test_operator_killed_mid_reconcile_converges_to_the_same_children(crds, namespace):
    op, rng, t0 = Operator(crds, namespace), random.Random(47), time.monotonic()
    try:
        for i in range(REPEATS):
            apply(crds, namespace, "chat", spec(8 + i))  # each a new engine template: a rollout to reconcile
            op.start()
            time.sleep(rng.uniform(0.5, 4.0))  # its start-up, a create, a patch or a status write
            op.stop(signal.SIGKILL)
        op.start()
        last = 8 + REPEATS - 1
        wait_until("the children of the last spec", lambda: converged(crds, namespace, last), timeout=90)
        time.sleep(4)  # a few resyncs more change nothing
        objs = converged(crds, namespace, last)
        assert objs is not None
        uid = crds.get("llms", "chat", namespace)["metadata"]["uid"]
        for name, o in objs.items():  # no orphan: each child owned by the resource, once
            assert [r["uid"] for r in o["metadata"].get("ownerReferences", [])] == [uid], name
        log(f"  operator killed {REPEATS} times mid-reconcile, converged: {time.monotonic() - t0:.1f}s")
    finally:
        crds.kubectl("delete", "llms", "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False)
        op.close()


def get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status
    except OSError:
        return 0


def apiserver_pid(cluster) -> int:
    return int((Path(cluster.kubeconfig).parent / "kube-apiserver.pid").read_text())


def test_the_autoscaler_killed_mid_decision_and_the_api_server_stopped_leave_serving_untouched(
        crds, namespace, tmp_path):
    if not crds.local:
        pytest.skip("needs the local cluster (make cluster): its API server is stopped and resumed")
    op, t0 = Operator(crds, namespace), time.monotonic()
    op.start()
    logs = REPO / ".pytest_cache" / "k8s"
    logs.mkdir(parents=True, exist_ok=True)
    scaler_cmd = [sys.executable, "-m", "slofleet.cli", "autoscaler", "--kubernetes", "--namespace", namespace,
                  "--cold-start", "10"]
    scaler_log = open(logs / f"autoscaler-faults-{namespace}.log", "ab")
    scaler = router = None
    try:
        apply(crds, namespace, "chat", spec(8))
        wait_until("Ready=True", lambda: condition(crds.get("llms", "chat", namespace) or {}, "Ready") == "True",
                   timeout=90)
        pods = [p["status"]["podIP"] for p in crds.items("pods", namespace, "slofleet.dev/service=chat")]
        urls = [f"http://{ip}:{port}/ready" for ip in pods for port in (8000, 8080)]
        urls = [u for u in urls if get_status(u) == 200]  # each pod answers on its own port
        assert len(urls) == 2, urls
        for _ in range(REPEATS):  # killed at random points of its loop: nothing half-done
            scaler = subprocess.Popen(scaler_cmd, env=crds.env, stdout=scaler_log, stderr=subprocess.STDOUT)
            time.sleep(random.uniform(0.5, 3.0))
            scaler.kill()
            scaler.wait()
        assert crds.get("deployment", "chat-unified", namespace)["spec"]["replicas"] == 1
        scaler = subprocess.Popen(scaler_cmd, env=crds.env, stdout=scaler_log, stderr=subprocess.STDOUT)
        # a router outside the cluster, discovering the engines through the API server as the router pod does
        router = RouterProc("--k8s-llmservice", f"{namespace}/chat", log=tmp_path / "router.log",
                            env={"KUBECONFIG": crds.kubeconfig}).wait_ready()
        urls.append(router.url + "/ready")
        pid = apiserver_pid(crds)
        os.killpg(pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while time.monotonic() - stopped < OUTAGE:  # the data plane answers all along
                assert [get_status(u) for u in urls] == [200] * len(urls)
                time.sleep(1.0)
            assert op.proc.poll() is None and scaler.poll() is None  # both wait it out
        finally:
            os.killpg(pid, signal.SIGCONT)
        apply(crds, namespace, "chat", spec(9))  # all resumes: the operator reconciles the next change
        wait_until("the change after the outage", lambda: converged(crds, namespace, 9), timeout=90)
        assert crds.get("deployment", "chat-unified", namespace)["spec"]["replicas"] == 1  # the autoscaler held
        assert scaler.poll() is None and get_status(router.url + "/ready") == 200
        log(f"  autoscaler kills, API server stopped {OUTAGE:g}s: {time.monotonic() - t0:.1f}s")
    finally:
        for p in (scaler,):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)
        if router is not None:
            router.stop()
        scaler_log.close()
        crds.kubectl("delete", "llms", "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False)
        op.close()
