"""Prefill -> decode hand-off between two real engine processes over HTTP."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from slofleet.api.contract import KV_MAC_HEADER, PREFILL_HEADER
from slofleet.engine.kv_transfer import KVPayload
from slofleet.engine.server.handoff import mac
from tests.support.server import INTERNAL_TOKEN, prefill_decode_pair

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"authorization": f"Bearer {INTERNAL_TOKEN}"}  # as the router sends it


def handed_to(url: str) -> dict:
    return {**AUTH, PREFILL_HEADER: url}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with prefill_decode_pair(tmp_path_factory.mktemp("pd"), "--num-blocks", "128") as engines:
        yield engines


def test_disaggregated_equals_unified(pair):
    pre, dec = pair
    body = {"model": MODEL, "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]}
    unified = httpx.post(dec.url + "/v1/chat/completions", json=body, timeout=300, headers=AUTH).json()
    computed = dec.metrics()["slofleet:prompt_tokens_computed_total{}"]
    handed = httpx.post(dec.url + "/v1/chat/completions", json=body, timeout=300, headers=handed_to(pre.url)).json()
    assert handed["choices"][0]["message"]["content"] == unified["choices"][0]["message"]["content"]
    assert handed["usage"]["completion_tokens"] == unified["usage"]["completion_tokens"]
    m = dec.metrics()
    assert m["slofleet:prompt_tokens_computed_total{}"] == computed  # the decode engine computed no prompt token
    assert pre.metrics()["slofleet:prompt_tokens_computed_total{}"] >= unified["usage"]["prompt_tokens"]


class CorruptingRelay:
    """Test stand-in between the two engines: forwards /v1/kv/prefill to the real prefill engine and scrambles
    one block of the KV it carries back, so the decode engine's output shows whether it used the transfer. Signed
    with the service's token (a fault at the source), or not (a fault in transit, which the MAC catches)."""

    def __init__(self, upstream: str, sign: bool = True):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                r = httpx.post(upstream + self.path, content=body, timeout=300,
                               headers={"content-type": "application/json", **AUTH})
                payload = KVPayload.from_bytes(r.content)
                payload.k[:, 1].normal_()  # every layer's keys and values of the second block
                payload.v[:, 1].normal_()
                data = payload.to_bytes()
                self.send_response(r.status_code)
                self.send_header("content-type", "application/octet-stream")
                if sign:
                    self.send_header(KV_MAC_HEADER, mac(INTERNAL_TOKEN, data))
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
        good = httpx.post(dec.url + "/v1/chat/completions", json=body, timeout=300, headers=handed_to(pre.url)).json()
        bad = httpx.post(dec.url + "/v1/chat/completions", json=body, timeout=300,
                         headers=handed_to(relay.url)).json()
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
                   headers=handed_to("http://127.0.0.1:9"), timeout=60)
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]


def test_kv_altered_in_transit_is_refused(pair):
    pre, dec = pair
    relay = CorruptingRelay(pre.url, sign=False)
    prompt = "Name three rivers in Europe and one fact about each, then three more in Asia."  # 2+ KV blocks
    try:
        r = httpx.post(dec.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                       headers=handed_to(relay.url), timeout=300)
    finally:
        relay.server.shutdown()
    assert r.status_code == 502 and "not signed" in r.json()["error"]["message"]


def test_the_internal_token_guards_the_engines_and_the_hand_off(pair):
    pre, dec = pair
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(dec.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 401  # a client that reached an engine's Service directly
    r = httpx.post(dec.url + "/v1/completions", json=body, timeout=60, headers={PREFILL_HEADER: pre.url})
    assert r.status_code == 401
    assert httpx.get(dec.url + "/metrics", timeout=10).status_code == 200  # probes and metrics stay open
    assert httpx.get(dec.url + "/ready", timeout=10).status_code == 200
    r = httpx.post(pre.url + "/v1/kv/prefill", json={"prompt_token_ids": [1, 2, 3]}, timeout=60)
    assert r.status_code == 401


@pytest.mark.parametrize("url", ["http://169.254.169.254", "http://169.254.169.254:80/latest/meta-data",
                                 "file:///etc/passwd", "http://metadata.google.internal:80", "http://0.0.0.0:80",
                                 "http://user:pw@127.0.0.1:80", "gopher://127.0.0.1:70"])
def test_the_prefill_url_reaches_only_plain_engine_addresses(pair, url):
    _, dec = pair
    r = httpx.post(dec.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers=handed_to(url), timeout=60)
    assert r.status_code == 400 and "prefill URL must be" in r.json()["error"]["message"]
