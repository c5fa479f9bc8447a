"""An LLMService's engine pod, as the operator renders it, run as a real container (the engine image from `make
image`: Debian's packages and the project, imported into containerd without a registry) by a real kubelet (built
by `make kubelet`, standalone: the pod is a static pod, hostNetwork). It goes Ready through the kubelet's own
probes, runs as the non-root user and on the read-only root filesystem the chart sets, under the resource limits
the spec asks for as cgroup limits, and answers a completion. The node runner stays for every other test."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from slofleet.api.contract import INTERNAL_TOKEN_ENV
from slofleet.api.v1alpha1 import LLMService
from slofleet.operator.podspec import pod_template
from tests.support.containers import IMAGE_BUILD, KUBELET_BUILD, Containerd, Kubelet, missing
from tests.support.server import INTERNAL_TOKEN, free_port

pytestmark = pytest.mark.slow

MEMORY_LIMIT = 3 * 2**30
CPU_LIMIT = "1500m"


def built(script: Path, *env: str) -> str:
    found = subprocess.run([str(script), "--cached"], capture_output=True, text=True, timeout=120,
                           env=os.environ | dict(e.split("=", 1) for e in env))
    if found.returncode:
        pytest.skip(found.stderr.strip().splitlines()[-1] if found.stderr.strip() else f"{script} --cached failed")
    return found.stdout.strip()


@pytest.fixture(scope="module")
def node():
    why = missing()
    if why:
        pytest.skip(why)
    kubelet_bin = built(KUBELET_BUILD)
    runtime = Containerd().start()
    try:
        image = built(IMAGE_BUILD, f"CONTAINERD_ADDRESS={runtime.address}")
        kubelet = Kubelet(binary=kubelet_bin, runtime=runtime).start()
        try:
            yield kubelet, image
        finally:
            kubelet.stop()
    finally:
        runtime.stop()


def engine_pod(image: str, port: int) -> dict:
    svc = LLMService.model_validate({"metadata": {"name": "boxed", "namespace": "default"}, "spec": {
        "engine": {"port": port, "maxModelLen": 512, "kvCacheMemoryGb": 0.25,
                   "resources": {"requests": {"cpu": "500m", "memory": "1Gi"},
                                 "limits": {"cpu": CPU_LIMIT, "memory": "3Gi"}}},
        "topology": {"unified": {"replicas": 1}}, "router": {"enabled": False}}})
    template = pod_template(svc, "unified", [], "test")
    spec = template["spec"]
    (engine,) = spec["containers"]
    engine["image"], engine["imagePullPolicy"] = image, "Never"
    # A kubelet without an API server has no Secrets: the token the operator's Secret would give, as a value.
    engine["env"] = [{"name": e["name"], "value": INTERNAL_TOKEN} if e["name"] == INTERNAL_TOKEN_ENV else e
                     for e in engine["env"]]
    spec["hostNetwork"] = True
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "boxed-engine", "namespace": "default",
                                                           "labels": template["metadata"]["labels"]}, "spec": spec}


def status_of(kubelet: Kubelet, name: str) -> dict | None:
    try:
        pods = kubelet.pods()
    except OSError:  # its read-only port opens a few seconds after it starts
        return None
    return next((p["status"] for p in pods if p["metadata"]["name"].startswith(name)), None)


def ready(status: dict | None) -> bool:
    return bool(status) and any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))


def test_engine_pod_runs_as_a_container_under_the_kubelet(node):
    kubelet, image = node
    port, t0 = free_port(), time.monotonic()
    pod = engine_pod(image, port)
    c = pod["spec"]["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] and pod["spec"]["securityContext"]["runAsNonRoot"]
    kubelet.run(pod)
    deadline = time.monotonic() + 600
    while not ready(status := status_of(kubelet, "boxed-engine")):
        assert time.monotonic() < deadline, f"{status}\n{kubelet.log()[-3000:]}"
        time.sleep(1)
    # Without an API server the kubelet knows no node address, so a hostNetwork pod gets no pod IP: POD_IP is
    # empty, the engine listens on every address and the kubelet probes it on loopback.
    ip = status.get("podIP") or "127.0.0.1"
    r = httpx.post(f"http://{ip}:{port}/v1/completions", timeout=120, headers={
        "Authorization": f"Bearer {INTERNAL_TOKEN}"}, json={"prompt": "The capital of France is", "max_tokens": 4,
                                                            "temperature": 0, "model": "SmolLM2-135M-Instruct"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    # The engine's process, found through containerd: its tasks' PIDs as the host sees them.
    pids = [line.split()[1] for line in kubelet.runtime.ctr("tasks", "ls").splitlines()[1:]]
    proc = next(Path(f"/proc/{pid}") for pid in pids if b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes())
    uids = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("Uid:")).split()[1:]
    assert set(uids) == {str(pod["spec"]["securityContext"]["runAsUser"])}
    root = next(line for line in (proc / "mountinfo").read_text().splitlines() if line.split()[4] == "/")
    assert " ro," in f" {root.split()[5]},", root
    cgroups = dict(line.split(":", 2)[1:] for line in (proc / "cgroup").read_text().splitlines())
    memory = Path("/sys/fs/cgroup/memory") / cgroups["memory"].lstrip("/")
    assert int((memory / "memory.limit_in_bytes").read_text()) == MEMORY_LIMIT
    cpu = Path("/sys/fs/cgroup/cpu") / cgroups["cpu,cpuacct" if "cpu,cpuacct" in cgroups else "cpu"].lstrip("/")
    quota, period = int((cpu / "cpu.cfs_quota_us").read_text()), int((cpu / "cpu.cfs_period_us").read_text())
    assert quota / period == 1.5
    print(f"engine container Ready and answering in {time.monotonic() - t0:.1f}s")
