"""End to end against the real API server: the operator and `slofleet autoscaler --kubernetes` as processes,
real `slofleet serve` engines as node-runner pods. Load grows the engine's queue; the autoscaler raises
status.autoscaling.unified.desiredReplicas and the operator's Deployment follows; when the load stops, it
scales back down after the stabilization window; each change is an Event."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.k8s.conftest import REPO, engine_auth, log, use_real_cli, wait_until
from tests.k8s.test_operator import UNIFIED, apply, condition, operator  # noqa: F401 (operator: a fixture)

STABILIZE_S = 20
SPEC = {"engine": {**UNIFIED["engine"], "maxNumSeqs": 2, "kvCacheMemoryGb": 0.25, "maxModelLen": 1024,
                   # the machine's converted model, not a fresh emptyDir's conversion per pod
                   "env": {"SLOFLEET_CACHE": os.path.expanduser("~/.cache/slofleet")}},
        "topology": {"unified": {"minReplicas": 1, "maxReplicas": 2}},
        "autoscaling": {"enabled": True, "intervalSeconds": 2, "scaleDownStabilizationSeconds": STABILIZE_S}}


@pytest.fixture
def autoscaler(crds, namespace):
    logs = REPO / ".pytest_cache" / "k8s"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"autoscaler-{namespace}.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "slofleet.cli", "autoscaler", "--kubernetes",
                                 "--namespace", namespace, "--cold-start", "10"],
                                env=crds.env, stdout=out, stderr=subprocess.STDOUT)
    yield proc
    proc.terminate()
    proc.wait(20)


class Load:
    """Many concurrent long completions against one engine, so its queue (max_num_seqs 2) grows. Closing it
    cancels the requests in flight: the engine aborts them on the disconnect, so the load stops at once."""

    def __init__(self, url: str, model: str, headers: dict[str, str], concurrency: int = 14):
        self.url, self.model, self.headers, self.concurrency = url, model, headers, concurrency
        self.done, self.errors, self.tasks = 0, [], []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.main(),), daemon=True)
        self.thread.start()

    async def main(self) -> None:
        async with httpx.AsyncClient(timeout=120, headers=self.headers) as c:
            self.tasks = [asyncio.create_task(self.client(c, i)) for i in range(self.concurrency)]
            for r in await asyncio.gather(*self.tasks, return_exceptions=True):
                if not isinstance(r, asyncio.CancelledError):
                    self.errors.append(r)

    async def client(self, c: httpx.AsyncClient, i: int) -> None:
        while True:
            r = await c.post(f"{self.url}/v1/completions", json={
                "model": self.model, "prompt": f"Client {i} counts slowly:", "max_tokens": 48,
                "ignore_eos": True, "temperature": 0})
            r.raise_for_status()
            self.done += 1

    def close(self) -> None:
        self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in self.tasks])
        self.thread.join(30)
        self.loop.close()


def decision(cluster, ns: str) -> dict:
    return ((cluster.get("llms", "scaled", ns) or {}).get("status") or {}).get("autoscaling", {}).get("unified") or {}


def replicas(cluster, ns: str) -> int | None:
    dep = cluster.get("deployment", "scaled-unified", ns)
    return dep["spec"]["replicas"] if dep else None


@pytest.mark.slow
def test_queue_growth_scales_up_and_idle_scales_down(crds, namespace, operator, autoscaler):  # noqa: F811
    if not crds.local:
        pytest.skip("needs the test-only node runner (pods run the image elsewhere)")
    t0 = time.monotonic()
    use_real_cli(crds, namespace)
    apply(crds, namespace, "scaled", SPEC)
    wait_until("Ready=True", lambda: condition(crds.get("llms", "scaled", namespace), "Ready") == "True", timeout=240)
    # Idle at the minimum: the autoscaler holds 1 replica and says why.
    held = wait_until("a first decision", lambda: (d := decision(crds, namespace)).get("condition") not in
                      (None, "MetricsStale") and d, timeout=30)
    assert held["desiredReplicas"] == 1 and held["reason"]
    log(f"  engine Ready, first decision: {time.monotonic() - t0:.1f}s")

    pod = crds.items("pods", namespace, "slofleet.dev/service=scaled,slofleet.dev/role=unified")[0]
    url = f"http://{pod['status']['podIP']}:8000"
    auth = engine_auth(crds, namespace, "scaled")
    model = httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]
    load = Load(url, model, auth)
    try:
        up = wait_until("desiredReplicas 2", lambda: (d := decision(crds, namespace)).get("desiredReplicas") == 2 and d,
                        timeout=90)
        assert "waiting per replica" in up["reason"] or "attainment" in up["reason"]
        wait_until("the Deployment at 2", lambda: replicas(crds, namespace) == 2, timeout=30)
        log(f"  scaled up ({up['reason']}): {time.monotonic() - t0:.1f}s")
    finally:
        load.close()
    assert not load.errors, load.errors  # cancelled, not failed
    stopped = time.monotonic()

    down = wait_until("desiredReplicas 1", lambda: (d := decision(crds, namespace)).get("desiredReplicas") == 1 and d,
                      timeout=STABILIZE_S + 60)
    assert time.monotonic() - stopped >= STABILIZE_S - 2, "scaled down inside the stabilization window"
    assert "scale down to 1" in down["reason"]
    wait_until("the Deployment at 1", lambda: replicas(crds, namespace) == 1, timeout=30)
    log(f"  scaled down ({down['reason']}): {time.monotonic() - t0:.1f}s")

    events = json.loads(crds.kubectl("get", "events", "-n", namespace, "-o", "json", "--field-selector",
                                     "involvedObject.name=scaled,source=slofleet-autoscaler").stdout)["items"]
    reasons = {e["reason"]: e["message"] for e in events}
    assert reasons["ScaledUp"].startswith("unified: 1 -> 2: scale up to 2")
    assert reasons["ScaledDown"].startswith("unified: 2 -> 1: scale down to 1")
    raw = crds.kubectl("get", "llms", "scaled", "-n", namespace, "-o", "json", "--show-managed-fields").stdout
    managers = {f["manager"] for f in json.loads(raw)["metadata"]["managedFields"]
                if f.get("subresource") == "status" and "f:autoscaling" in json.dumps(f.get("fieldsV1", {}))}
    assert managers == {"slofleet-autoscaler"}  # one writer of status.autoscaling
