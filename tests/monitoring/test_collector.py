"""Traces into a real OpenTelemetry Collector (its OTLP receiver, batch processor and file exporter, built from the
collector's Go modules by `make otelcol`), not the stand-in of tests/support/otlp.py: one chat request through a
router and a real engine, both exporting by OTLP/HTTP, lands in the collector's file as the router's and the
engine's spans under the client's one trace id, the engine's spans below the router's."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from slofleet.api.contract import INTERNAL_TOKEN_ENV
from tests.router.test_engines import MODEL
from tests.support import ROOT
from tests.support.router import RouterProc
from tests.support.server import INTERNAL_TOKEN, Server, free_port

pytestmark = pytest.mark.slow

BUILD = ROOT / "tools" / "otelcol" / "build.sh"
TRACE_ID, CLIENT_SPAN = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
FAST = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # each process exports within 0.1 s, not the default 5 s


def config(port: int, out: Path) -> str:
    # The collector's own telemetry off: its default metrics port is fixed and would collide between runs.
    return json.dumps({
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"127.0.0.1:{port}"}}}},
        "processors": {"batch": {"timeout": "100ms"}},
        "exporters": {"file": {"path": str(out), "flush_interval": "100ms"}},
        "service": {"telemetry": {"metrics": {"level": "none"}},
                    "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"],
                                             "exporters": ["file"]}}}})


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    found = subprocess.run([str(BUILD), "--cached"], capture_output=True, text=True, timeout=120)
    if found.returncode:
        pytest.skip("the OpenTelemetry Collector is not built: run `make otelcol`")
    d = tmp_path_factory.mktemp("otelcol")
    port, out, log = free_port(), d / "traces.jsonl", d / "collector.log"
    (d / "config.yaml").write_text(config(port, out))  # JSON is YAML
    proc = subprocess.Popen([found.stdout.strip(), "--config", f"file:{d / 'config.yaml'}"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        # OTLP/HTTP answers 405 to a GET on its path once it listens.
        deadline = time.monotonic() + 60
        while not listening(port):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", out
    finally:
        proc.terminate()
        proc.wait(30)


def listening(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v1/traces", timeout=1).status_code == 405
    except httpx.HTTPError:
        return False


def spans(out: Path) -> list[dict]:
    """Every span in the file exporter's OTLP JSON lines, with its resource's service.name."""
    found = []
    for line in out.read_text().splitlines() if out.exists() else []:
        for rs in json.loads(line)["resourceSpans"]:
            attrs = {a["key"]: a["value"].get("stringValue") for a in rs["resource"]["attributes"]}
            found += [{**s, "service": attrs.get("service.name")} for ss in rs["scopeSpans"] for s in ss["spans"]]
    return found


def test_router_and_engine_spans_land_in_the_collector_under_one_trace(collector, tmp_path):
    url, out = collector
    token = {INTERNAL_TOKEN_ENV: INTERNAL_TOKEN}
    engine = Server("--max-num-seqs", "2", "--num-blocks", "256", "--otlp-traces-endpoint", url,
                    log=tmp_path / "engine.log", env={**token, **FAST})
    try:
        engine.wait_ready()
        router = RouterProc("--upstream", engine.url, "--otlp-traces-endpoint", url, log=tmp_path / "router.log",
                            env={**token, **FAST}).wait_ready()
        try:
            r = httpx.post(router.url + "/v1/chat/completions", timeout=120, headers={
                "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 30
            while {s["service"] for s in spans(out) if s["traceId"] == TRACE_ID} < {"slofleet-router",
                                                                                   "slofleet-engine"}:
                assert time.monotonic() < deadline, f"spans in the collector: {spans(out)}"[:3000]
                time.sleep(0.2)
        finally:
            router.stop()
    finally:
        engine.stop()
    ours = [s for s in spans(out) if s["traceId"] == TRACE_ID]
    by_id = {s["spanId"]: s for s in ours}
    root = next(s for s in ours if s["service"] == "slofleet-router" and s["parentSpanId"] == CLIENT_SPAN)
    engine_spans = [s for s in ours if s["service"] == "slofleet-engine"]
    # The engine's top spans hang below the router's upstream call: one trace, joined across the processes.
    tops = [s for s in engine_spans if by_id.get(s["parentSpanId"], {}).get("service") != "slofleet-engine"]
    assert tops, ours
    for s in tops:
        parent = by_id.get(s["parentSpanId"])
        assert parent and parent["service"] == "slofleet-router" and parent["name"] == "upstream", (s, parent)
    assert root["name"] == "POST /v1/chat/completions"
