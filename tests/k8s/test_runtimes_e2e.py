"""LLMServices with `engine.runtime: vllm` and `llamacpp` on the local cluster, end to end: `kubectl apply` -> the
operator's pods (an init step puts the embedded model in an emptyDir; the node runner runs the installs that
`make install-runtimes` cached in place of the images) -> Ready; chat and completions through the router with
`model` = the service's name; status.buckets; scale 1 -> 2 under queue growth and back to 1 with no failed stream;
`slofleet diagnose --json` on the queue-dominated fault that growth is (llamacpp: all but the scaling, see
QUEUE_SEEN). One vLLM start per replica (it compiles for over a minute at each), one namespace per runtime. The
first test checks the runner's share (init containers, exec probes, resourceFieldRef) with stand-in processes, so
it runs where the runtimes are not installed."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from slofleet.api.contract import LLAMACPP, VLLM
from slofleet.bench import runtimes
from tests.k8s.conftest import REPO, log, use_real_cli, wait_until
from tests.k8s.test_autoscale_e2e import autoscaler  # noqa: F401 (a fixture)
from tests.k8s.test_operator import apply, condition, operator  # noqa: F401 (a fixture)

STABILIZE_S = 20
# The runtimes whose queue the autoscaler and diagnose read: vLLM's vllm:num_requests_waiting is the name slofleet's
# engine exports. TODO(rtrouter): llamacpp, once they read llama-server's (llamacpp:requests_deferred), which its
# API key guards with the rest of /metrics (the scrape answers 401), or work from the router's per-bucket clocks.
QUEUE_SEEN = {VLLM}
# Compiled graphs kept between pods and runs (a test speed-up only: each pod would otherwise compile again in its
# own emptyDir); torch's inductor cache would follow TMPDIR into the pod's /tmp.
COMPILE_CACHE = Path(os.environ.get("SLOFLEET_RUNTIMES_CACHE", Path.home() / ".cache" / "slofleet" / "runtimes"))
BUCKETS = [{"name": "chat", "priority": 0, "match": {"route": "/v1/chat/completions"},
            "slo": {"percentile": 90, "ttftMs": 60000}},
           {"name": "doc", "priority": 5, "slo": {"percentile": 90, "e2eMs": 120000}}]


def spec(runtime: str) -> dict:
    env = {"VLLM_CACHE_ROOT": str(COMPILE_CACHE / "vllm-compile"),
           "TORCHINDUCTOR_CACHE_DIR": str(COMPILE_CACHE / "vllm-compile" / "inductor")} if runtime == VLLM else {}
    # TODO(rtrouter): drop blockSize once the operator renders a block size vLLM's CPU attention takes (a multiple
    # of 32; it refuses slofleet's default 16 at start: "No common block size for 16").
    block = {"blockSize": 32} if runtime == VLLM else {}
    return {"engine": {"runtime": runtime, "maxNumSeqs": 2, "maxModelLen": 1024, "kvCacheMemoryGb": 1,
                       "drainSeconds": 20, "env": env, **block,
                       "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "4Gi"}}},
            "buckets": BUCKETS, "topology": {"unified": {"minReplicas": 1, "maxReplicas": 2}},
            "autoscaling": {"enabled": True, "intervalSeconds": 2, "scaleDownStabilizationSeconds": STABILIZE_S}}


# A stand-in for a runtime's pod: an init container fills an emptyDir, the server answers from it and shows its
# memory limit, and its readiness is an exec probe (as vLLM's is).
STAND_IN = """
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
body = (open(sys.argv[1]).read() + " " + os.environ["MEM_MI"]).encode()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
HTTPServer((os.environ["POD_IP"], 8000), H).serve_forever()
"""


def stand_in_pod(ready_file: str) -> dict:
    shared = [{"name": "model", "mountPath": "/models"}]
    first = {"name": "fetch", "image": "x", "command": ["python3", "-c", "open('/models/part', 'w').write('weights')",
                                                        ], "volumeMounts": shared}
    second = {"name": "convert", "image": "x", "volumeMounts": shared, "command": [
        "python3", "-c", "import os; os.rename('/models/part', '/models/model.txt')"]}
    engine = {"name": "engine", "image": "x", "command": ["python3", "-c", STAND_IN, "/models/model.txt"],
              "volumeMounts": shared, "resources": {"limits": {"memory": "300Mi"}},
              "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                      {"name": "MEM_MI", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory",
                                                                             "divisor": "1Mi"}}}],
              "readinessProbe": {"exec": {"command": ["test", "-e", ready_file]}, "periodSeconds": 1}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stand-in"},
            "spec": {"initContainers": [first, second], "containers": [engine],
                     "volumes": [{"name": "model", "emptyDir": {}}]}}


def test_init_containers_exec_probes_and_resource_fields_on_the_node_runner(crds, namespace, tmp_path):
    if not crds.local:
        pytest.skip("checks the test-only node runner")
    ready_file = tmp_path / "ready"
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(stand_in_pod(str(ready_file))))
    pod = wait_until("the engine running", lambda: (p := crds.get("pod", "stand-in", namespace)) and any(
        s["state"].get("running") for s in p["status"].get("containerStatuses", [])) and p, timeout=30)
    inits = {s["name"]: s["state"] for s in pod["status"]["initContainerStatuses"]}
    assert inits["fetch"]["terminated"]["exitCode"] == 0 and inits["convert"]["terminated"]["reason"] == "Completed"
    assert condition(pod, "Initialized") == "True" and condition(pod, "Ready") == "False"  # its probe fails so far
    answer = wait_until("an answer", lambda: httpx.get(f"http://{pod['status']['podIP']}:8000/", timeout=2).text)
    assert answer == "weights 300"  # the second init step saw the first's file; the limit in MiB
    ready_file.touch()
    wait_until("Ready", lambda: condition(crds.get("pod", "stand-in", namespace), "Ready") == "True", timeout=15)


class Streams:
    """`concurrency` clients streaming chat and completions through the router without pause, each in its own
    bucket's route, with `model` = the service's name. Counts what finished and every stream that failed (an
    error status, or an end without [DONE]); closing it cancels the ones in flight, which is no failure."""

    def __init__(self, url: str, model: str, concurrency: int, max_tokens: int = 32):
        self.url, self.model, self.concurrency, self.max_tokens = url, model, concurrency, max_tokens
        self.done, self.failed, self.tasks = 0, [], []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.main(),), daemon=True)
        self.thread.start()

    async def main(self) -> None:
        async with httpx.AsyncClient(timeout=300) as c:
            self.tasks = [asyncio.create_task(self.client(c, i)) for i in range(self.concurrency)]
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def client(self, c: httpx.AsyncClient, i: int) -> None:
        n = 0
        while True:
            n += 1
            try:
                self.failed += await stream(c, self.url, self.model, i + n, self.max_tokens)
            except httpx.HTTPError as e:
                self.failed.append(f"{type(e).__name__}: {e}")
            self.done += 1

    def close(self) -> None:
        self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in self.tasks])
        self.thread.join(30)
        self.loop.close()


async def stream(c: httpx.AsyncClient, url: str, model: str, n: int, max_tokens: int) -> list[str]:
    """One streamed request (chat when n is even, a completion otherwise); [] if it ended with [DONE]."""
    chat = n % 2 == 0
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": f"Count slowly from {n}."}]} if chat else {
        "prompt": f"Story {n}: once upon a time"}
    async with c.stream("POST", f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    if r.status_code != 200 or not lines or lines[-1] != "data: [DONE]":
        return [f"{r.status_code} {lines[-1:]}"]
    return []


def replicas(cluster, ns: str, name: str) -> int | None:
    dep = cluster.get("deployment", f"{name}-unified", ns)
    return dep["spec"]["replicas"] if dep else None


def decision(cluster, ns: str, name: str) -> dict:
    st = (cluster.get("llms", name, ns) or {}).get("status") or {}
    return st.get("autoscaling", {}).get("unified") or {}


def answer(url: str, path: str, body: dict, cluster=None) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=300)
    assert r.status_code == 200, f"{r.text}\n{pod_logs(cluster) if cluster else ''}"
    return r.json()


def pod_logs(cluster, lines: int = 30) -> str:
    """The tails of the local cluster's router and engine logs (the node runner's, gone once the cluster is down)."""
    pods = Path(cluster.kubeconfig).parent / "pods"
    logs = [*pods.glob("*router*/router.log"), *pods.glob("*unified*/engine.log")]
    return "\n".join(f"--- {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:]) for f in logs)


def router_url(cluster, ns: str, name: str) -> str:
    pod = cluster.items("pods", ns, f"slofleet.dev/service={name},slofleet.dev/role=router")[0]
    return f"http://{pod['status']['podIP']}:8080"


def engine_urls(cluster, ns: str, name: str, ready: bool = False) -> list[str]:
    """The engine pods' URLs (`ready`: only those Ready, as a scrape of one still starting fails)."""
    pods = cluster.items("pods", ns, f"slofleet.dev/service={name},slofleet.dev/role=unified")
    return [f"http://{p['status']['podIP']}:8000" for p in pods
            if p["status"].get("podIP") and (not ready or condition(p, "Ready") == "True")]


def diagnose(folder: Path, ttft_ms: int, *urls: str) -> dict:
    """`slofleet diagnose --json` over the router and the engines, with the chat bucket's TTFT target tight."""
    path = folder / "buckets.json"
    buckets = [{**BUCKETS[0], "slo": {"percentile": 90, "ttftMs": ttft_ms}}, BUCKETS[1]]
    path.write_text(json.dumps({"spec": {"buckets": buckets}}))
    cmd = [sys.executable, "-m", "slofleet.cli", "diagnose", "--buckets", str(path), "--json", "--window", "10",
           *(f for u in urls for f in ("--url", u))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def router_role(crds):
    """The routers' ClusterRole (EndpointSlices), as an install puts it there, which the operator binds each
    router's ServiceAccount to; removed after, so the install tests find none of their own objects ahead."""
    import yaml

    from slofleet.operator.router import DEFAULT_CLUSTER_ROLE

    docs = yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text())
    role = next(d for d in docs if d and d["kind"] == "ClusterRole" and d["metadata"]["name"] == DEFAULT_CLUSTER_ROLE)
    crds.kubectl("apply", "-f", "-", input=json.dumps(role))
    yield
    crds.kubectl("delete", "clusterrole", DEFAULT_CLUSTER_ROLE, "--ignore-not-found", check=False)


def end_to_end(cluster, ns: str, runtime: str, tmp_path: Path) -> None:
    if not cluster.local:
        pytest.skip("needs the test-only node runner to run the cached runtimes in place of their images")
    if runtimes.find(runtime) is None:
        pytest.skip(runtimes.missing_reason(runtime))
    t0, name = time.monotonic(), f"rt-{runtime}"
    use_real_cli(cluster, ns)
    apply(cluster, ns, name, spec(runtime))
    wait_until("Ready=True", lambda: condition(cluster.get("llms", name, ns), "Ready") == "True", timeout=600,
               interval=2)
    pod = cluster.items("pods", ns, f"slofleet.dev/service={name},slofleet.dev/role=unified")[0]
    assert pod["metadata"]["labels"]["slofleet.dev/runtime"] == runtime
    assert [c["name"] for c in pod["spec"]["initContainers"]] and condition(pod, "Initialized") == "True"
    log(f"  {runtime}: Ready: {time.monotonic() - t0:.1f}s")

    url = router_url(cluster, ns, name)
    chat = answer(url, "/v1/chat/completions", {"model": name, "max_tokens": 8, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Say hello."}]}, cluster)
    assert chat["choices"][0]["message"]["content"].strip() and chat["model"] == name
    text = answer(url, "/v1/completions", {"model": name, "prompt": "The river runs", "max_tokens": 8})
    assert text["choices"][0]["text"].strip() and 0 < text["usage"]["completion_tokens"] <= 8
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert name in [m["id"] for m in models["data"]]
    scale_and_diagnose(cluster, ns, name, runtime, url, tmp_path, t0)


def scale_and_diagnose(cluster, ns: str, name: str, runtime: str, url: str, tmp_path: Path, t0: float) -> None:
    load = Streams(url, name, concurrency=10)
    try:
        if runtime in QUEUE_SEEN:
            up = wait_until("desiredReplicas 2", lambda: (d := decision(cluster, ns, name)).get("desiredReplicas") == 2
                            and d, timeout=120, interval=1)
            assert "waiting" in up["reason"] or "attainment" in up["reason"], up
            wait_until("the Deployment at 2", lambda: replicas(cluster, ns, name) == 2, timeout=30)
            log(f"  {runtime}: scaled up ({up['reason']}): {time.monotonic() - t0:.1f}s")
        else:
            wait_until("streams finishing", lambda: load.done >= 4, timeout=120)
        if runtime not in QUEUE_SEEN:
            return  # streamed through the router under queue growth, none failed (checked in finally)
        # The queue growth is the fault: a TTFT target the queue alone breaks.
        verdict = diagnose(tmp_path, 50, url, *engine_urls(cluster, ns, name, ready=True))
        if FULL:
            wait_until("both replicas Ready", lambda: ready_replicas(cluster, ns, name) == 2, timeout=600, interval=2)
            log(f"  {runtime}: second replica Ready: {time.monotonic() - t0:.1f}s")
    finally:
        load.close()
        assert load.done and not load.failed, load.failed[:5]
    assert (verdict["slow_clock"], verdict["bucket"]) == ("ttft", "chat"), verdict
    # TODO(rtrouter): assert verdict["dominant"] == "queue" once diagnose reads each runtime's own phases (vLLM's
    # unlabelled vllm:request_queue_time_seconds, llama.cpp's llamacpp:requests_deferred).
    log(f"  {runtime}: diagnose: {verdict['dominant']} {verdict.get('evidence', {}).get('shares')}")
    got = wait_until("status.buckets", lambda: {b["name"]: b for b in (cluster.get("llms", name, ns)["status"].get(
        "buckets") or [])}, timeout=30)
    # TODO(rtrouter): assert got["chat"]["requests"] > 0 and its attainment, once status.buckets comes from the
    # router's per-bucket clocks (neither runtime's histograms carry a bucket label).
    assert set(got) == {"chat", "doc"}, got
    log(f"  {runtime}: status.buckets: {list(got.values())}")
    if runtime in QUEUE_SEEN and FULL:
        scale_down(cluster, ns, name, runtime, url, t0)


def scale_down(cluster, ns: str, name: str, runtime: str, url: str, t0: float) -> None:
    trickle = Streams(url, name, concurrency=1, max_tokens=8)  # streams in flight while the extra replica drains
    try:
        down = wait_until("desiredReplicas 1", lambda: (d := decision(cluster, ns, name)).get("desiredReplicas") == 1
                          and d, timeout=STABILIZE_S + 120, interval=1)
        wait_until("one engine pod left", lambda: len(engine_urls(cluster, ns, name)) == 1, timeout=120)
        time.sleep(2)
    finally:
        trickle.close()
    assert trickle.done and not trickle.failed, trickle.failed[:5]
    log(f"  {runtime}: scaled down ({down['reason']}) with {trickle.done} streams, none failed: "
        f"{time.monotonic() - t0:.1f}s")


# A second vLLM compiling beside a loaded first one on two cores takes over ten minutes: `make test` checks the
# scale-up decision and the second pod, and SLOFLEET_E2E_FULL=1 also waits for it to serve and for the scale-down.
FULL = os.environ.get("SLOFLEET_E2E_FULL") == "1"


def ready_replicas(cluster, ns: str, name: str) -> int:
    dep = cluster.get("deployment", f"{name}-unified", ns) or {}
    return (dep.get("status") or {}).get("readyReplicas") or 0


@pytest.mark.slow
def test_vllm_service_end_to_end(crds, router_role, namespace, operator, autoscaler, tmp_path):  # noqa: F811
    end_to_end(crds, namespace, VLLM, tmp_path)


@pytest.mark.slow
def test_llamacpp_service_end_to_end(crds, router_role, namespace, operator, autoscaler, tmp_path):  # noqa: F811
    end_to_end(crds, namespace, LLAMACPP, tmp_path)
