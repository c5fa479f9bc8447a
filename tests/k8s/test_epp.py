"""The Gateway API Inference Extension's own endpoint picker (EPP, cmd/epp of the version tools/epp/go.mod names,
built by `make epp`) in front of two real engines, through the InferencePool the operator made for them: the
extension's real CRDs installed, the picker watching the pool and scraping the engines' metrics under its default
names, and asked the way a gateway asks (ext-proc, by tools/epp's epp-pick). It sends requests to the engine whose
KV cache is less used when queues are equal, and away from the engine with a queue."""
from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import httpx
import pytest

from tests.k8s.conftest import REPO, free_ports, log, use_real_cli, wait_until
from tests.k8s.test_operator import UNIFIED, apply, condition, operator  # noqa: F401 (operator: the fixture)

pytestmark = pytest.mark.slow

BUILD = REPO / "tools" / "epp" / "build.sh"
# The extension's chart's default plugins (its scheduling profile picks the highest score).
CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: prefix-cache-scorer
"""
# Two engines that queue past two running requests, with a small KV pool that a few long requests fill visibly;
# a gateway in front (its namespace named): the engines take its requests without the router's token.
SPEC = {"engine": {**UNIFIED["engine"], "maxNumSeqs": 2, "kvCacheMemoryGb": 0.1, "maxModelLen": 1024},
        "topology": {"unified": {"minReplicas": 2, "maxReplicas": 2, "replicas": 2}}, "router": {"enabled": False},
        "network": {"gatewayNamespace": "gw", "endpointPicker": {"name": "epp"}}}
PICKS = 12


@pytest.fixture(scope="module")
def epp_build() -> Path:
    found = subprocess.run([str(BUILD), "--cached"], capture_output=True, text=True, timeout=120)
    if found.returncode:
        pytest.skip("the endpoint picker is not built: run `make epp`")
    return Path(found.stdout.strip())


@pytest.fixture
def extension_crds(crds, epp_build):
    """The extension's own CRDs (InferencePool v1, InferenceObjective: the picker watches both), installed before
    the operator starts, removed after (test_inference_pool installs a stand-in under the same name)."""
    if not crds.local:
        pytest.skip("needs the test-only node runner (pod IPs on this machine)")
    files = sorted((epp_build / "crds").glob("*.yaml"))
    for f in files:
        crds.kubectl("apply", "--server-side", "-f", str(f))
    names = [f"crd/{plural}.{group}" for group, plural in (f.stem.split("_", 1) for f in files)]
    crds.kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)
    yield
    for f in files:
        crds.kubectl("delete", "-f", str(f), "--wait=true", "--timeout=90s", check=False)


class Picker:
    """cmd/epp as a process over one pool, and epp-pick to ask it."""

    def __init__(self, build: Path, cluster, ns: str, pool: str, logs: Path):
        self.build, self.grpc = build, free_ports(1)
        cmd = [str(build / "epp"), "--pool-name", pool, "--pool-namespace", ns, "--grpc-port", str(self.grpc),
               "--grpc-health-port", str(free_ports(1)), "--metrics-port", str(free_ports(1)),
               "--secure-serving=false", "--enable-pprof=false", "--refresh-metrics-interval=200ms",
               "--config-text", CONFIG]
        self.log = open(logs, "ab")
        self.proc = subprocess.Popen(cmd, env=cluster.env, stdout=self.log, stderr=subprocess.STDOUT)

    def pick(self, bodies: list[dict]) -> list[str]:
        out = subprocess.run([str(self.build / "epp-pick"), "-addr", f"127.0.0.1:{self.grpc}"], text=True,
                             input="".join(json.dumps(b) + "\n" for b in bodies), capture_output=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()


def gauges(endpoint: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.split("{")[0].split()[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(("vllm:num_requests_", "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"))}


class Load:
    """Long streamed completions held open against one engine, closed (so aborted) on stop."""

    def __init__(self, endpoint: str, model: str, n: int):
        self.stop_ = threading.Event()
        body = {"model": model, "max_tokens": 600, "ignore_eos": True, "stream": True}
        self.threads = [threading.Thread(target=self.run, args=(endpoint, {**body, "prompt": f"{i} {PROMPT}"}),
                                         daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def run(self, endpoint: str, body: dict) -> None:
        with httpx.stream("POST", f"http://{endpoint}/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if self.stop_.is_set():
                    return

    def stop(self) -> None:
        self.stop_.set()
        for t in self.threads:
            t.join(30)


PROMPT = "The history of the lighthouse keepers on the northern coast, told season by season: " * 6


def bodies(model: str, n: int) -> list[dict]:
    # Each prompt its own: the prefix-cache scorer must not steer these picks.
    return [{"model": model, "prompt": f"{uuid.uuid4().hex} tell me something", "max_tokens": 1} for _ in range(n)]


def test_picker_routes_by_engine_load(crds, namespace, extension_crds, operator, epp_build):  # noqa: F811
    t0, ns = time.monotonic(), namespace
    use_real_cli(crds, ns)
    apply(crds, ns, "gw", SPEC)
    pool = wait_until("the InferencePool", lambda: crds.get("inferencepool", "gw-unified", ns), timeout=60)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    wait_until("Ready=True", lambda: condition(crds.get("llms", "gw", ns), "Ready") == "True", timeout=600)
    port = pool["spec"]["targetPorts"][0]["number"]
    a, b = sorted(f"{p['status']['podIP']}:{port}" for p in crds.items("pods", ns, "slofleet.dev/service=gw"))
    with urllib.request.urlopen(f"http://{a}/v1/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    log(f"  two engines Ready behind the pool: {time.monotonic() - t0:.1f}s")
    picker = Picker(epp_build, crds, ns, pool["metadata"]["name"], REPO / ".pytest_cache" / "k8s" / f"epp-{ns}.log")
    try:
        both = wait_until("the picker choosing among both engines",
                          lambda: {a, b} <= set(picker.pick(bodies(model, PICKS))), timeout=60)
        assert both
        # KV: two long requests running on A (no queue on either), so only KV usage tells the engines apart.
        load = Load(a, model, 2)
        try:
            wait_until("A's KV in use", lambda: (g := gauges(a))["vllm:num_requests_running"] == 2
                       and g["vllm:gpu_cache_usage_perc"] > 0.05, timeout=90, interval=0.2)
            assert gauges(a)["vllm:num_requests_waiting"] == 0
            time.sleep(1)  # past the picker's refresh
            assert set(picker.pick(bodies(model, PICKS))) == {b}
        finally:
            load.stop()
        wait_until("A idle", lambda: gauges(a)["vllm:num_requests_running"] == 0, timeout=60)
        # Queue: six on B, four of them waiting; the picker turns to A (whatever A's cached KV blocks).
        load = Load(b, model, 6)
        try:
            wait_until("B's queue", lambda: gauges(b)["vllm:num_requests_waiting"] >= 3, timeout=60, interval=0.2)
            time.sleep(1)
            assert set(picker.pick(bodies(model, PICKS))) == {a}
        finally:
            load.stop()
    finally:
        picker.close()
    log(f"  picker followed KV usage and queue: {time.monotonic() - t0:.1f}s")
    # Without vllm:lora_requests_info the picker logs an ERROR on every metrics refresh of every engine; the engines
    # export it empty, and the picker's log has no error at all.
    lines = (REPO / ".pytest_cache" / "k8s" / f"epp-{ns}.log").read_text().splitlines()
    assert not [line for line in lines if "\tERROR\t" in line], "\n".join(lines[-20:])
