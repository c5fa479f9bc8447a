"""One trace per request across router, prefill engine and decode engine (real engines on loopback): a client's
trace context is continued by every hop, the engines' spans come from their lifecycle events (a span per prefill
chunk, the KV hand-off, decode with its step count), the router's /debug/traces merges them, `slofleet trace` draws
them, and every process exports them by OTLP to a stand-in collector. Engines answer with x-request-id too, and a
client's own id used twice at once does not mix the two requests up."""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import httpx
import pytest

from slofleet.api.contract import INTERNAL_TOKEN_ENV
from tests.support import ROOT
from tests.support.otlp import OTLPStandIn
from tests.support.router import RouterProc
from tests.support.server import INTERNAL_TOKEN, prefill_decode_pair

from .test_disaggregated import LONG
from .test_engines import ENGINE_FLAGS, MODEL

pytestmark = pytest.mark.slow

TRACE_ID, CLIENT_SPAN, RID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", "pd-trace-1"
AUTH = {"authorization": f"Bearer {INTERNAL_TOKEN}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d, otlp = tmp_path_factory.mktemp("traced"), OTLPStandIn()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s, not the default 5 s
        # a small token budget: the ~300-token prompt is prefilled in several chunks
        with prefill_decode_pair(d, *ENGINE_FLAGS, "--max-num-batched-tokens", "64",
                                 "--otlp-traces-endpoint", otlp.url) as (pre, dec):
            r = RouterProc("--prefill-upstream", pre.url, "--decode-upstream", dec.url, "--prefill-threshold-tokens",
                           "128", "--otlp-traces-endpoint", otlp.url, log=d / "router.log",
                           env={INTERNAL_TOKEN_ENV: INTERNAL_TOKEN}).wait_ready()
            try:
                yield pre, dec, r, otlp
            finally:
                r.stop()
                otlp.stop()


@pytest.fixture(scope="module")
def traced(fleet) -> dict:
    """One long chat request through the router with a client's traceparent, and its merged trace once complete."""
    r = fleet[2]
    resp = httpx.post(r.url + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": LONG, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True},
        headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": RID})
    assert resp.status_code == 200 and "[DONE]" in resp.text and resp.headers["x-request-id"] == RID
    deadline = time.monotonic() + 20
    while True:  # each process records its spans as its response ends
        doc = httpx.get(f"{r.url}/debug/traces/{RID}", timeout=10).json()
        roots = {(s["role"], s["name"]) for s in doc["spans"]}
        if {("router", "POST /v1/chat/completions"), ("decode", "POST /v1/chat/completions"),
                ("prefill", "POST /v1/kv/prefill")} <= roots:
            return doc
        assert time.monotonic() < deadline, roots
        time.sleep(0.1)


def test_one_disaggregated_request_is_one_trace_across_router_prefill_and_decode(fleet, traced):
    spans = traced["spans"]
    assert traced["trace_id"] == TRACE_ID and {s["trace_id"] for s in spans} == {TRACE_ID}
    at = {(s["role"], s["name"]): s for s in spans}
    router, decode, prefill = (at[(role, name)] for role, name in (
        ("router", "POST /v1/chat/completions"), ("decode", "POST /v1/chat/completions"),
        ("prefill", "POST /v1/kv/prefill")))
    # one tree: client -> router -> its try upstream -> decode engine -> its KV hand-off -> prefill engine
    assert router["parent_id"] == CLIENT_SPAN
    assert decode["parent_id"] == at[("router", "upstream")]["span_id"]
    assert prefill["parent_id"] == at[("decode", "kv_handoff")]["span_id"]
    assert {s["attributes"]["slofleet.request_id"] for s in (router, decode, prefill)} == {RID}
    for role, names in (("router", {"gateway", "classify", "choose", "upstream", "stream"}),
                        ("decode", {"parse", "kv_handoff", "queue", "kv_import", "decode", "stream"}),
                        ("prefill", {"parse", "queue", "prefill", "prefill_chunk", "kv_export", "kv_send"})):
        assert names <= {s["name"] for s in spans if s["role"] == role}, role
    chunks = [s for s in spans if s["name"] == "prefill_chunk"]
    assert len(chunks) >= 4 and at[("prefill", "prefill")]["attributes"]["slofleet.chunks"] == len(chunks)
    assert all(c["parent_id"] == at[("prefill", "prefill")]["span_id"] for c in chunks)
    assert at[("decode", "kv_import")]["attributes"]["slofleet.computed_tokens"] == 0
    dec = at[("decode", "decode")]["attributes"]
    assert dec["slofleet.output_tokens"] == 6 and dec["slofleet.steps"] == 5
    assert all(s["end_ns"] >= s["start_ns"] for s in spans)
    assert not any("content" in str(s["attributes"]) for s in spans), "no prompt text in spans"

    pre, dec_engine, r, otlp = fleet
    names = frozenset({"upstream", "kv_handoff", "POST /v1/kv/prefill", "prefill_chunk"})
    assert names <= {name for _, name, _ in otlp.wait_for(TRACE_ID, {"slofleet-router", "slofleet-engine"}, names)}
    m = r.metrics()
    assert m["slofleet:router_phase_seconds_count{bucket=default,phase=handoff}"] == 1  # from the Server-Timing
    # an engine's own debug endpoint keeps its part, under the internal token
    assert httpx.get(f"{pre.url}/debug/traces/{RID}", timeout=5).status_code == 401
    own = httpx.get(f"{pre.url}/debug/traces/{RID}", headers=AUTH, timeout=5).json()
    assert {s["role"] for s in own["spans"]} == {"prefill"}


def test_slofleet_trace_prints_the_waterfall_and_writes_a_png(fleet, traced, tmp_path):
    png = tmp_path / "trace.png"
    done = subprocess.run([sys.executable, "-m", "slofleet.cli", "trace", fleet[2].url, RID, "--png", str(png),
                           "--width", "50"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    print(out)
    assert f"trace {TRACE_ID}" in out and f"request {RID}" in out
    lines = {line.split()[3] if len(line.split()) > 3 else "": line for line in out.splitlines()[2:]}
    assert {"POST", "gateway", "upstream", "kv_handoff", "prefill_chunk", "decode", "stream"} <= set(lines)
    assert "█" in lines["decode"] and "steps=5" in lines["decode"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_engines_answer_with_request_ids_and_a_reused_one_does_not_mix_requests(fleet):
    dec = fleet[1]

    def ask(rid: str | None, text: str) -> httpx.Response:
        return httpx.post(dec.url + "/v1/completions", timeout=120, headers={**AUTH, **({"x-request-id": rid} if rid
                          else {})}, json={"model": MODEL, "prompt": text, "max_tokens": 4, "temperature": 0})

    alone = [ask(None, t).json()["choices"][0]["text"] for t in ("One, two,", "Paris is")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda t: ask("same-id", t), ("One, two,", "Paris is")))
    assert [b.headers["x-request-id"] for b in both] == ["same-id", "same-id"]
    assert [b.json()["choices"][0]["text"] for b in both] == alone
    generated = ask(None, "Hi").headers["x-request-id"]
    assert len(generated) == 24 and generated != ask(None, "Hi").headers["x-request-id"]
    assert len(httpx.get(dec.url + "/health", timeout=5).headers["x-request-id"]) == 24
