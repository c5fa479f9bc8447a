"""The router's side of the trust boundary: with the service's internal token in its environment, every request it
sends an engine (generation, the prefill hand-off, /v1/models, probes) carries `Authorization: Bearer <token>`,
and a client's own Authorization never does."""
from __future__ import annotations

import httpx

from slofleet.api.contract import INTERNAL_TOKEN_ENV, PREFILL_HEADER
from tests.support.router import RouterProc

from .helpers import StandIn

TOKEN = "internal-token-for-tests"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there, a prompt"}], "stream": True}


class Recording(StandIn):
    """A stand-in that also notes the headers of every request it gets, by path."""

    def __init__(self):
        self.heads: list[tuple[str, dict[str, str]]] = []
        super().__init__()
        self.max_model_len = 4096  # so the router asks /v1/models when it turns ready

    async def app(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.heads.append((scope["path"], {k.decode(): v.decode() for k, v in scope["headers"]}))
        await super().app(scope, receive, send)

    def auth(self, path: str) -> set[str | None]:
        return {h.get("authorization") for p, h in self.heads if p == path}


def test_every_engine_request_carries_the_internal_token_never_the_clients(tmp_path):
    engine = Recording()
    router = RouterProc("--upstream", engine.url, log=tmp_path / "router.log", env={INTERNAL_TOKEN_ENV: TOKEN})
    try:
        router.wait_ready()
        r = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=30,
                       headers={"authorization": "Bearer client-key"})
        assert r.status_code == 200 and "[DONE]" in r.text
        assert httpx.get(router.url + "/v1/models", timeout=30).status_code == 200
    finally:
        router.stop()
        engine.stop()
    for path in ("/v1/chat/completions", "/v1/models", "/ready"):
        assert engine.auth(path) == {f"Bearer {TOKEN}"}, path


def test_the_prefill_hand_off_request_carries_the_token(tmp_path):
    prefill, decode = Recording(), Recording()
    router = RouterProc("--prefill-upstream", prefill.url, "--decode-upstream", decode.url,
                        "--prefill-threshold-tokens", "1", log=tmp_path / "router.log", env={INTERNAL_TOKEN_ENV: TOKEN})
    try:
        router.wait_ready()
        assert httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
    handed = [h for p, h in decode.heads if p == "/v1/chat/completions"]
    assert [(h[PREFILL_HEADER], h["authorization"]) for h in handed] == [(prefill.url, f"Bearer {TOKEN}")]
    assert prefill.auth("/ready") == {f"Bearer {TOKEN}"}


def test_without_a_token_nothing_is_sent(tmp_path):
    engine = Recording()
    router = RouterProc("--upstream", engine.url, log=tmp_path / "router.log", env={INTERNAL_TOKEN_ENV: ""})
    try:
        router.wait_ready()
        r = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=30,
                       headers={"authorization": "Bearer client-key"})
        assert r.status_code == 200
    finally:
        router.stop()
        engine.stop()
    assert engine.auth("/v1/chat/completions") == {None}
