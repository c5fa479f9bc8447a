"""The router's SLO clocks: TTFT, TPOT and E2E per bucket, timed from the bytes it relays, through a real router in
front of a stand-in engine that streams tokens at a known pace (as vLLM, llama-server or slofleet's engine would),
and the priority field sent only to the runtimes that order by it."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from slofleet.api.v1alpha1 import SLO
from slofleet.router.clocks import Clocks, clocks, met, output_tokens
from slofleet.router.http1 import Progress
from tests.support.router import RouterProc
from tests.support.server import serve_in_thread

FIRST, GAP = 0.15, 0.05  # the stand-in's seconds to its first token, and between tokens


class Paced:
    """Streams `max_tokens` chat or completion events, the first after FIRST s and each next GAP s later, with a
    usage event when asked; records each request's `priority` field (absent: None). Like vLLM and llama-server,
    it has /health and no /ready."""

    def __init__(self) -> None:
        self.priorities: list[object] = []
        self.server, self.thread, self.url = serve_in_thread(self.app)

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] in ("/ready", "/health", "/metrics"):  # as vLLM and llama-server: no /ready
            await send({"type": "http.response.start", "status": 404 if scope["path"] == "/ready" else 200,
                        "headers": []})
            return await send({"type": "http.response.body", "body": b"llamacpp:requests_deferred 2\n"})
        raw, more = b"", True
        while more:
            msg = await receive()
            raw, more = raw + msg.get("body", b""), msg.get("more_body", False)
        req = json.loads(raw)
        self.priorities.append(req.get("priority", "absent"))
        chat, n = scope["path"].endswith("chat/completions"), req["max_tokens"]
        if not req.get("stream"):
            await asyncio.sleep(FIRST + GAP * (n - 1))
            body = {"choices": [{"text": "x" * n}], "usage": {"completion_tokens": n}}
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            return await send({"type": "http.response.body", "body": json.dumps(body).encode()})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        event = lambda d: {"type": "http.response.body", "body": f"data: {json.dumps(d)}\n\n".encode(),  # noqa: E731
                           "more_body": True}
        if chat:  # vLLM's opening: the role, no text
            await send(event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
        for i in range(n):
            await asyncio.sleep(FIRST if i == 0 else GAP)
            await send(event({"choices": [{"delta": {"content": "t"}} if chat else {"text": "t"}]}))
        if (req.get("stream_options") or {}).get("include_usage"):
            await send(event({"choices": [], "usage": {"completion_tokens": n}}))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


BUCKETS = {"buckets": [
    {"name": "chat", "priority": 0, "match": {"route": "/v1/chat"}, "slo": {"ttftMs": 1000, "tpotMs": 200}},
    {"name": "batch", "priority": 2, "slo": {"ttftMs": 100}},  # a TTFT the stand-in always misses
]}


@pytest.fixture(scope="module")
def paced():
    engine = Paced()
    yield engine
    engine.stop()


def histogram(m: dict[str, float], name: str, bucket: str) -> tuple[float, float]:
    return m[f"{name}_count{{bucket={bucket}}}"], m[f"{name}_sum{{bucket={bucket}}}"]


@pytest.mark.parametrize("runtime,priority", [("vllm", 0), ("llamacpp", "absent")])
def test_the_router_times_each_stream_per_bucket_whatever_runs_behind(tmp_path, paced, runtime, priority):
    (tmp_path / "b.json").write_text(json.dumps(BUCKETS))
    r = RouterProc("--upstream", paced.url, "--buckets", str(tmp_path / "b.json"), "--runtime", runtime,
                   log=tmp_path / "router.log").wait_ready()
    try:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        assert httpx.post(r.url + "/v1/chat/completions", json=chat, timeout=10).status_code == 200
        done = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}
        assert httpx.post(r.url + "/v1/completions", json=done, timeout=10).status_code == 200
        whole = {"model": "m", "prompt": "hi", "max_tokens": 3}
        assert httpx.post(r.url + "/v1/completions", json=whole, timeout=10).status_code == 200
        assert paced.priorities[-3] == priority, "the bucket's priority goes to vllm, nothing to llamacpp"
        m = r.metrics()
        n, ttft = histogram(m, "slofleet:router_time_to_first_token_seconds", "chat")
        assert n == 1 and FIRST <= ttft < FIRST + 0.5, "TTFT: the first token, not the role-only opening"
        n, tpot = histogram(m, "slofleet:router_time_per_output_token_seconds", "chat")
        assert n == 1 and GAP * 0.8 <= tpot < GAP * 3, f"TPOT over the 4 gaps after the first of 5 tokens: {tpot}"
        n, e2e = histogram(m, "slofleet:router_e2e_request_latency_seconds", "chat")
        assert n == 1 and e2e >= FIRST + 4 * GAP
        # a streamed and a whole completion; the whole one's first token is its last byte, and it has no TPOT
        n, ttft = histogram(m, "slofleet:router_time_to_first_token_seconds", "batch")
        assert n == 2 and ttft >= FIRST + (FIRST + 2 * GAP)
        assert histogram(m, "slofleet:router_time_per_output_token_seconds", "batch")[0] == 1
        assert m["slofleet:router_slo_requests_total{bucket=chat,met=true}"] == 1
        assert m["slofleet:router_slo_requests_total{bucket=batch,met=false}"] == 2
        assert m["slofleet:router_slo_requests_total{bucket=batch,met=true}"] == 0
    finally:
        r.stop()


def test_output_tokens_prefer_usage_and_else_count_content_events():
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    tok = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    done = b"data: [DONE]\n\n"
    # first chunk: the role and the first token; then three chunks of a token each, then [DONE] alone
    got = Progress(chunks=4, tail=done, before=tok, events=4)
    assert output_tokens(role + tok, got) == 4
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":17}}\n\n'
    assert output_tokens(tok, Progress(chunks=2, tail=done, before=usage, events=2)) == 17
    # llama-server closes a chat stream with an event of no text: not a token
    close = b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}]}\n\n'
    assert output_tokens(role + tok, Progress(chunks=2, tail=close + done, before=tok, events=3)) == 2
    # vLLM's last token carries the finish reason: a token
    last = b'data: {"choices":[{"delta":{"content":"b"},"finish_reason":"stop"}]}\n\n'
    assert output_tokens(role + tok, Progress(chunks=2, tail=done, before=last, events=2)) == 2
    # the whole answer in the first chunk: a role event that also carries text is a token
    opening = b'data: {"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}\n\n'
    assert output_tokens(opening + tok + done, Progress(chunks=0, tail=b"")) == 2


def test_clocks_and_whether_they_meet_a_bucket():
    c = clocks(10.0, 10.3, 11.3, 11, streamed=True)
    assert c == Clocks(ttft=pytest.approx(0.3), tpot=pytest.approx(0.1), e2e=pytest.approx(1.3))
    assert clocks(10.0, 10.3, 11.3, 11, streamed=False) == Clocks(ttft=pytest.approx(1.3), tpot=None,
                                                                   e2e=pytest.approx(1.3))
    assert clocks(0.0, 0.2, 0.2, 1, streamed=True).tpot is None  # one token: no time per output token
    assert met(SLO(ttft_ms=400, tpot_ms=100), c) is True
    assert met(SLO(ttft_ms=400, tpot_ms=99), c) is False
    assert met(SLO(e2e_ms=1000), c) is False
    assert met(None, c) is None


def test_events_are_counted_across_reads():
    from slofleet.router.http1 import Conn

    c = Conn()
    for part in (b'data: {"text":"a"}\n', b'\ndata: {"text":"b"}\n\nda', b'ta: [DONE]\n\n'):
        c.seen(part)
    assert (c.events, c.relayed, c.tail, c.before) == (3, 3, b"ta: [DONE]\n\n", b'\ndata: {"text":"b"}\n\nda')


def test_each_runtime_is_probed_and_loaded_by_its_own_names():
    from slofleet.router.replicas import parse_load, scraped

    text = "llamacpp:requests_deferred 3\nllamacpp:requests_processing 2\nvllm:num_requests_waiting 9\n"
    assert parse_load(text, scraped("llamacpp")) == {"waiting": 3.0, "running": 2.0}  # no KV gauge
    assert parse_load(text, scraped("vllm")) == {"waiting": 9.0, "running": 0.0, "kv_usage": 0.0}

