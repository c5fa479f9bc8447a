"""Fixtures for tests against a real Kubernetes API server.

By default the session starts its own control plane (tests/cluster/up.sh: etcd, kube-apiserver,
kube-controller-manager built from Go modules, plus the test-only node runner) in a private state folder
and on private ports, and stops it at the end. With SLOFLEET_K8S_KUBECONFIG set, the same tests run
against that cluster (kind, k3d) instead and nothing is started.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.server import free_port

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "tests" / "cluster"
FAKEBIN = Path(__file__).resolve().parent / "fakebin"


_capture = None


@pytest.fixture(scope="session", autouse=True)
def _capture_manager(pytestconfig):
    global _capture
    _capture = pytestconfig.pluginmanager.get_plugin("capturemanager")


def log(msg: str) -> None:
    # Past pytest's output capture: phase timings belong in the CI log.
    if _capture is None:
        print(f"[k8s] {msg}", file=sys.stderr, flush=True)
        return
    with _capture.global_and_fixture_disabled():
        print(f"\n[k8s] {msg}", file=sys.stderr, flush=True)


@dataclass
class Cluster:
    kubeconfig: str
    bin: Path | None  # helm etc.; None on an external cluster (helm then from PATH)
    local: bool  # the test-only node runner runs pods (so they go Ready without images)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": self.kubeconfig}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True, env=self.env, timeout=120)
        if check and r.returncode:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
        return r

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        helm = str(self.bin / "helm") if self.bin else "helm"
        r = subprocess.run([helm, *args], capture_output=True, text=True, env=self.env, timeout=180)
        if check and r.returncode:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
        return r

    def get(self, kind: str, name: str, ns: str | None = None) -> dict | None:
        r = self.kubectl("get", kind, name, "-o", "json", *(["-n", ns] if ns else []), check=False)
        if r.returncode:
            if "NotFound" in r.stderr:
                return None
            raise AssertionError(r.stderr)
        return json.loads(r.stdout)

    def items(self, kind: str, ns: str, selector: str = "") -> list[dict]:
        r = self.kubectl("get", kind, "-n", ns, "-o", "json", *(["-l", selector] if selector else []))
        return json.loads(r.stdout)["items"]


PATH_ANNOTATION = "noderunner.slofleet.dev/path"  # tests/cluster/noderunner.py: its pods' PATH
REAL_PATH = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"


def use_real_cli(cluster: Cluster, ns: str) -> None:
    """The namespace's pods run the real `slofleet` CLI, not the fake engine this session's PATH finds first. As an
    annotation, not a pod env PATH: the runner relocates env paths under a pod's mounts (/tmp), and a clone may
    live under /tmp."""
    cluster.kubectl("annotate", "namespace", ns, f"{PATH_ANNOTATION}={REAL_PATH}", "--overwrite")


def engine_auth(cluster: Cluster, ns: str, service: str) -> dict[str, str]:
    """The header the router sends an engine of `service`: its internal token, from the operator's Secret (the node
    runner gives engine pods the env they take from it, as a kubelet does, so they refuse /v1/* without it)."""
    from slofleet.api.contract import INTERNAL_TOKEN_KEY
    from slofleet.api.v1alpha1 import LLMService
    from slofleet.operator.podspec import secret_name

    name = secret_name(LLMService.model_validate({"metadata": {"name": service, "namespace": ns}, "spec": {}}))
    token = base64.b64decode(cluster.get("secret", name, ns)["data"][INTERNAL_TOKEN_KEY]).decode()
    return {"Authorization": f"Bearer {token}"}


def wait_until(what: str, fn, timeout: float = 60, interval: float = 0.5, more=None):
    """fn's first truthy answer within timeout; else an AssertionError with its last answer and more()'s text."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except AssertionError as e:
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    extra = f"; {more()}" if more else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}{extra}"[:3000])


def free_ports(n: int) -> int:
    """The first of n consecutive free loopback ports (etcd takes two: clients and peers)."""
    return free_port(n)


@pytest.fixture(scope="session")
def cluster():
    external = os.environ.get("SLOFLEET_K8S_KUBECONFIG")
    if external:
        probe = Cluster(external, None, local=False)
        # Pods there become Ready only with real images, or where our node runner runs (make cluster).
        probe.local = probe.get("node", "slofleet-node") is not None
        yield probe
        return
    state = Path(tempfile.mkdtemp(prefix="slofleet-k8s-"))
    env = {**os.environ, "SLOFLEET_CLUSTER_DIR": str(state), "SLOFLEET_APISERVER_PORT": str(free_ports(1)),
           "SLOFLEET_ETCD_PORT": str(free_ports(2)), "PYTHON": sys.executable,
           # The node runner runs pods' commands from here: the fake engine first, then the system.
           "SLOFLEET_NODE_PATH": f"{FAKEBIN}:{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    t0 = time.monotonic()
    up = subprocess.run([str(CLUSTER / "up.sh")], env=env, capture_output=True, text=True, timeout=3600)
    for line in up.stderr.splitlines():
        if line.startswith("cluster:") or "built in" in line or "building" in line:
            log(line)
    if up.returncode:
        subprocess.run([str(CLUSTER / "down.sh"), "--purge"], env=env)
        raise RuntimeError(f"control plane did not start:\n{up.stderr[-5000:]}")
    built = subprocess.run([str(CLUSTER / "build.sh")], capture_output=True, text=True, check=True)
    bin_dir = Path(built.stdout.strip())
    log(f"phase control plane up: {time.monotonic() - t0:.1f}s")
    try:
        yield Cluster(str(state / "kubeconfig"), bin_dir, local=True)
    finally:
        t1 = time.monotonic()
        subprocess.run([str(CLUSTER / "down.sh"), "--purge"], env=env, capture_output=True, timeout=120)
        log(f"phase control plane down: {time.monotonic() - t1:.1f}s")


@pytest.fixture(scope="session")
def crds(cluster: Cluster) -> Cluster:
    """The CRDs applied with kubectl, as a user would, and established."""
    t0 = time.monotonic()
    apply_crds(cluster)
    log(f"phase CRDs applied: {time.monotonic() - t0:.1f}s")
    return cluster


def apply_crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/llmservices.slofleet.dev", "crd/slopolicies.slofleet.dev")


@pytest.fixture
def namespace(crds: Cluster):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    crds.kubectl("create", "namespace", ns)
    yield ns
    crds.kubectl("delete", "namespace", ns, "--wait=false", check=False)
