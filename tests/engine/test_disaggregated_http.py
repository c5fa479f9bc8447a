"""Prefill -> decode hand-off between two real engine processes over HTTP."""
from __future__ import annotations

import httpx
import pytest

from .server import Server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pd")
    flags = ("--num-blocks", "128")
    pre = Server("--role", "prefill", *flags, log=d / "prefill.log")
    dec = Server("--role", "decode", *flags, log=d / "decode.log")
    try:
        pre.wait_ready()
        dec.wait_ready()
        yield pre, dec
    finally:
        pre.stop()
        dec.stop()


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


def test_unreachable_prefill_engine_is_502(pair):
    _, dec = pair
    r = httpx.post(dec.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers={"x-slofleet-prefill-url": "http://127.0.0.1:9"}, timeout=60)
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
