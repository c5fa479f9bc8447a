"""Prefill -> decode hand-off between two real engine processes over HTTP."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from slofleet.engine.kv_transfer import KVPayload

from .server import prefill_decode_pair

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with prefill_decode_pair(tmp_path_factory.mktemp("pd"), "--num-blocks", "128") as engines:
        yield engines


def test_disaggregated_equals_unified(pair):
    pre, dec = pair
    body = {"model": MODEL, "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]}
    unified = httpx.post(dec.url + "/v1/chat/completions", json=body, timeout=300).json()
    computed = dec.metrics()["slofleet:prompt_tokens_computed_total{}"]
    handed = httpx.post(dec.url + "/v1/chat/completions", json=body, timeout=300,
                        headers={"x-slofleet-prefill-url": pre.url}).json()
    assert handed["choices"][0]["message"]["content"] == unified["choices"][0]["message"]["content"]
    assert handed["usage"]["completion_tokens"] == unified["usage"]["completion_tokens"]
    m = dec.metrics()
    assert m["slofleet:prompt_tokens_computed_total{}"] == computed  # the decode engine computed no prompt token
    assert pre.metrics()["slofleet:prompt_tokens_computed_total{}"] >= unified["usage"]["prompt_tokens"]


class CorruptingRelay:
    """Test stand-in between the two engines: forwards /v1/kv/prefill to the real prefill engine and scrambles
    one block of the KV it carries back, so the decode engine's output shows whether it used the transfer."""

    def __init__(self, upstream: str):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                r = httpx.post(upstream + self.path, content=body, timeout=300,
                               headers={"content-type": "application/json"})
                payload = KVPayload.from_bytes(r.content)
                payload.k[:, 1].normal_()  # every layer's keys and values of the second block
                payload.v[:, 1].normal_()
                data = payload.to_bytes()
                self.send_response(r.status_code)
                self.send_header("content-type", "application/octet-stream")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_corrupted_block_in_transit_changes_the_output(pair):
    pre, dec = pair
    body = {"model": MODEL, "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]}
    relay = CorruptingRelay(pre.url)
    try:
        good = httpx.post(dec.url + "/v1/chat/completions", json=body, timeout=300,
                          headers={"x-slofleet-prefill-url": pre.url}).json()
        bad = httpx.post(dec.url + "/v1/chat/completions", json=body, timeout=300,
                         headers={"x-slofleet-prefill-url": relay.url}).json()
    finally:
        relay.server.shutdown()
    assert bad["choices"][0]["message"]["content"] != good["choices"][0]["message"]["content"]
    deadline = time.monotonic() + 10
    while dec.metrics()["vllm:kv_cache_usage_perc{}"] > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dec.metrics()["vllm:kv_cache_usage_perc{}"] == 0  # the imported blocks went back to the pool


def test_unreachable_prefill_engine_is_502(pair):
    _, dec = pair
    r = httpx.post(dec.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers={"x-slofleet-prefill-url": "http://127.0.0.1:9"}, timeout=60)
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
