"""Request ids, trace context and the router's own time, through a real router in front of a stand-in engine (no
model): a client's traceparent and x-request-id are kept and passed on, missing or malformed ones are replaced, every
response has an x-request-id, spans reach an OTLP receiver (a stand-in collector), and the phase metrics fill."""
from __future__ import annotations

import time

import httpx

from slofleet.tracing.core import SPANS_PER_REQUEST, Tracing, request_id
from slofleet.tracing.waterfall import render
from tests.support.otlp import OTLPStandIn
from tests.support.router import RouterProc

from .helpers import StandIn

TRACE_ID, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}


def trace_of(router: RouterProc, key: str, names: set[str], timeout: float = 10) -> dict:
    """The router's trace of a request once the spans named have ended (the root ends after the last byte)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{router.url}/debug/traces/{key}", timeout=5)
        if r.status_code == 200 and names <= {s["name"] for s in r.json()["spans"]}:
            return r.json()
        assert time.monotonic() < deadline, f"trace of {key}: {r.status_code} {r.text[:500]}"
        time.sleep(0.05)


def test_a_clients_trace_context_and_request_id_are_kept_and_exported(tmp_path):
    engine, otlp = StandIn(), OTLPStandIn()
    r = RouterProc("--upstream", engine.url, "--otlp-traces-endpoint", otlp.url, log=tmp_path / "router.log",
                   env={"OTEL_BSP_SCHEDULE_DELAY": "100"}).wait_ready()
    try:
        resp = httpx.post(r.url + "/v1/chat/completions", json=BODY, timeout=10,
                          headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": "client-id.1"})
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "client-id.1"
        seen = engine.received[-1]
        assert seen["request_id"] == "client-id.1", "the engine must get the client's request id"
        _, trace_id, parent, _ = seen["traceparent"].split("-")
        assert trace_id == TRACE_ID and parent != CLIENT_SPAN, "the engine continues the client's trace, under ours"

        doc = trace_of(r, "client-id.1", {"POST /v1/chat/completions", "gateway", "classify", "choose", "upstream",
                                          "stream"})
        assert doc["trace_id"] == TRACE_ID
        by_name = {s["name"]: s for s in doc["spans"]}
        root = by_name["POST /v1/chat/completions"]
        assert root["parent_id"] == CLIENT_SPAN and root["kind"] == "server"
        assert root["attributes"]["http.response.status_code"] == 200
        assert by_name["upstream"]["span_id"] == parent and by_name["upstream"]["kind"] == "client"
        assert by_name["upstream"]["attributes"]["slofleet.replica"] == engine.url
        assert by_name["classify"]["attributes"]["slofleet.bucket"] == "default"
        listed = httpx.get(r.url + "/debug/traces", timeout=5).json()["traces"]
        assert listed[0]["trace_id"] == TRACE_ID and listed[0]["request_ids"] == ["client-id.1"]

        # the spans come in batches as they end: wait for the last ones too, not only the first batch
        names = frozenset({"gateway", "upstream", "POST /v1/chat/completions"})
        got = otlp.wait_for(TRACE_ID, {"slofleet-router"}, names)
        assert names <= {name for _, name, _ in got}
        assert all(path == "/v1/traces" and ctype == "application/x-protobuf" for path, ctype, _ in otlp.requests)

        m = r.metrics()
        for phase in ("gateway", "classify", "choose", "upstream", "own", "stream"):
            assert m[f"slofleet:router_phase_seconds_count{{bucket=default,phase={phase}}}"] == 1, phase
        assert "slofleet:router_phase_seconds_count{bucket=default,phase=retry}" not in m  # it was not retried
    finally:
        r.stop()
        engine.stop()
        otlp.stop()


def test_request_ids_are_made_when_missing_or_malformed_and_on_every_answer(tmp_path):
    engine = StandIn()
    r = RouterProc("--upstream", engine.url, log=tmp_path / "router.log").wait_ready()
    try:
        ids = []
        for given in (None, "has space", "x" * 129, "ünï".encode(), "a;b"):
            headers = {} if given is None else {"x-request-id": given}
            resp = httpx.post(r.url + "/v1/chat/completions", json=BODY, headers=headers, timeout=10)
            rid = resp.headers["x-request-id"]
            assert rid != given and len(rid) == 24 and engine.received[-1]["request_id"] == rid
            ids.append(rid)
            # no traceparent came in: the router started the trace the engine continues
            trace_id = engine.received[-1]["traceparent"].split("-")[1]
            assert trace_of(r, rid, {"upstream"})["trace_id"] == trace_id
        assert len(set(ids)) == len(ids)
        for method, path in (("GET", "/health"), ("GET", "/nowhere"), ("POST", "/v1/completions")):
            resp = httpx.request(method, r.url + path, content=b"{" if method == "POST" else None, timeout=5)
            assert len(resp.headers["x-request-id"]) == 24, (path, resp.status_code)
        assert httpx.get(r.url + "/debug/traces/nothing-such", timeout=5).status_code == 404
    finally:
        r.stop()
        engine.stop()


def test_debug_traces_need_an_api_key_when_keys_are_set(tmp_path):
    engine = StandIn()
    r = RouterProc("--upstream", engine.url, log=tmp_path / "router.log",
                   env={"SLOFLEET_API_KEYS": "sk-a"}).wait_ready()
    try:
        assert httpx.get(r.url + "/debug/traces", timeout=5).status_code == 401
        ok = httpx.get(r.url + "/debug/traces", headers={"authorization": "Bearer sk-a"}, timeout=5)
        assert ok.status_code == 200 and ok.json() == {"traces": []}
    finally:
        r.stop()
        engine.stop()


def test_the_trace_store_stays_bounded_and_finds_one_request_in_a_shared_trace():
    tracing = Tracing("router", "router", keep=4)
    shared = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}  # a client sending everything under one trace
    for i in range(64):
        rt = tracing.begin("POST", "/v1/completions", shared, f"r{i}")
        rt.span("gateway", end_ns=time.time_ns())
        rt.end(200)
    recent = tracing.recent
    assert len(recent.requests) == 4  # the last four requests, however many shared their trace
    one = recent.get("r63")
    assert one["trace_id"] == TRACE_ID and [s["name"] for s in one["spans"]] == ["POST /v1/completions", "gateway"]
    assert recent.get("r0") is None  # aged out
    for i in range(5):  # new traces push the oldest out
        tracing.begin("POST", "/v1/completions", {}, f"n{i}").end(200)
    assert len(recent.requests) == 4 and recent.get(TRACE_ID) is None and recent.get("n4")["spans"]
    assert [t["request_ids"] for t in recent.summaries()] == [["n4"], ["n3"], ["n2"], ["n1"]]
    many = tracing.begin("POST", "/v1/completions", {}, "many")  # one request's spans are bounded too
    for i in range(SPANS_PER_REQUEST + 10):
        many.span("chunk", end_ns=time.time_ns(), index=i)
    many.end(200)
    assert len(recent.get("many")["spans"]) == SPANS_PER_REQUEST
    assert request_id("ok:1.a-b_c") == "ok:1.a-b_c" and request_id("a" * 128) == "a" * 128
    assert all(len(request_id(bad)) == 24 for bad in ("", "a" * 129, "a b", "a\n", "é", None))


def test_the_waterfall_nests_spans_and_scales_bars():
    ms = 1_000_000
    spans = [{"span_id": i, "parent_id": p, "name": n, "role": role, "start_ns": a * ms, "end_ns": b * ms,
              "attributes": attrs} for i, p, n, role, a, b, attrs in (
        ("1", "client", "POST /v1/completions", "router", 0, 100, {"slofleet.request_id": "r"}),
        ("2", "1", "upstream", "router", 10, 100, {}), ("3", "2", "POST /v1/completions", "decode", 12, 99, {}),
        ("4", "3", "decode", "decode", 50, 99, {"slofleet.steps": 7}))]
    text = render({"trace_id": TRACE_ID, "spans": spans}, width=10).splitlines()
    assert text[0].startswith(f"trace {TRACE_ID}  request r  100.0 ms  4 spans")
    assert text[2].split()[2:4] == ["router", "POST"] and "|██████████|" in text[2]
    assert text[5].split()[:4] == ["50.0", "49.0", "decode", "decode"] and text[5].endswith("|     █████| steps=7")
    assert [line.index(name, 30) for line, name in zip(text[3:], ("upstream", "POST", "decode"))] == [32, 34, 36]
