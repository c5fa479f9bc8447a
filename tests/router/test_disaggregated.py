"""Prefill/decode disaggregation through the router, with a real prefill and a real decode engine on loopback:
long prompts are prefilled on the prefill engine and continue on the decode engine with the same tokens as a
unified run; short prompts never touch the prefill engine; a failing or absent prefill replica costs no
request."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from slofleet.api.contract import INTERNAL_TOKEN_ENV
from tests.support.router import RouterProc
from tests.support.server import INTERNAL_TOKEN, prefill_decode_pair

from .helpers import StandIn
from .test_engines import DOC, ENGINE_FLAGS, MODEL

pytestmark = pytest.mark.slow

COMPUTED = "slofleet:prompt_tokens_computed_total{}"
LONG = [{"role": "user", "content": DOC * 6 + "Which colours is the lighthouse painted?"}]  # ~300 tokens
OTHER = [{"role": "user", "content": "A second port. " + DOC * 6 + "How many piers are there?"}]
SHORT = [{"role": "user", "content": "Say hi"}]
AUTH = {"authorization": f"Bearer {INTERNAL_TOKEN}"}  # the engines of a service answer its token holders only


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with prefill_decode_pair(tmp_path_factory.mktemp("pd-engines"), *ENGINE_FLAGS) as engines:
        yield engines


def router_for(tmp_path, prefill: str, decode: str) -> RouterProc:
    return RouterProc("--prefill-upstream", prefill, "--decode-upstream", decode, "--prefill-threshold-tokens", "128",
                      log=tmp_path / "router.log", env={INTERNAL_TOKEN_ENV: INTERNAL_TOKEN}).wait_ready()


def chat(base_url: str, messages: list[dict], **extra) -> str:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, **extra)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_long_prompts_are_prefilled_on_the_prefill_replica_short_ones_are_not(pair, tmp_path):
    pre, dec = pair
    r = router_for(tmp_path, pre.url, dec.url)
    try:
        pre0, dec0 = pre.metrics()[COMPUTED], dec.metrics()[COMPUTED]
        via_router = chat(r.url, LONG)
        pre1, dec1 = pre.metrics()[COMPUTED], dec.metrics()[COMPUTED]
        assert dec1 == dec0, "the decode engine computed prompt tokens of a handed-off prompt"
        assert pre1 - pre0 >= 250, "the prefill engine did not compute the long prompt"
        m = r.metrics()
        assert m["slofleet:router_pd_routes_total{bucket=default,route=disaggregated}"] == 1

        short = chat(r.url, SHORT)
        assert short and pre.metrics()[COMPUTED] == pre1, "a short prompt reached the prefill engine"
        assert dec.metrics()[COMPUTED] > dec1
        assert r.metrics()["slofleet:router_pd_routes_total{bucket=default,route=direct}"] == 1

        # The reference: the same prompt computed whole on one engine (no hand-off header), token for token.
        unified = httpx.post(dec.url + "/v1/chat/completions", timeout=300, headers=AUTH, json={
            "model": MODEL, "messages": LONG, "max_tokens": 12, "temperature": 0}).json()
        assert via_router == unified["choices"][0]["message"]["content"] and via_router
    finally:
        r.stop()


def test_a_failing_or_absent_prefill_replica_falls_back_to_the_decode_replica(pair, tmp_path):
    _, dec = pair
    broken = StandIn()  # ready by its probes, but its /v1/kv/prefill answers 500
    broken.status = 500
    r = router_for(tmp_path, broken.url, dec.url)
    try:
        dec0 = dec.metrics()[COMPUTED]
        text = chat(r.url, OTHER)
        assert text and broken.received, "the prefill replica was not asked"
        assert dec.metrics()[COMPUTED] - dec0 >= 250, "the decode engine did not prefill the prompt itself"
        assert r.metrics()["slofleet:router_pd_routes_total{bucket=default,route=fallback}"] == 1
        broken.stop()  # now no prefill replica is up at all
        deadline = time.monotonic() + 10
        while r.metrics()[f"slofleet:router_replica_ready{{replica={broken.url}}}"] != 0:
            assert time.monotonic() < deadline, "the stopped prefill replica was not taken out"
            time.sleep(0.1)
        received = len(broken.received)
        assert chat(r.url, OTHER) == text and len(broken.received) == received
        assert r.metrics()["slofleet:router_pd_routes_total{bucket=default,route=fallback}"] == 2
    finally:
        r.stop()
        broken.stop()
