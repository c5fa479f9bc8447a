"""What an engine serves by its role, draining before removal (POST/DELETE /v1/drain), and the end of SIGTERM's
grace period: a stream still open gets an SSE error event, not a cut connection."""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from slofleet.api.contract import INTERNAL_TOKEN_ENV
from slofleet.engine.config import EngineConfig
from slofleet.engine.server.api import build_app
from slofleet.engine.server.settings import ServerSettings
from tests.support.server import INTERNAL_TOKEN, Server

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def client(role: str) -> TestClient:
    # Not entered: no lifespan, so no model loads; routing and the guard answer without it.
    return TestClient(build_app(EngineConfig(role=role), ServerSettings(internal_token=INTERNAL_TOKEN)))


def auth(token: str = INTERNAL_TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_a_prefill_engine_refuses_generation_and_a_decode_engine_the_prefill_endpoint():
    pre, dec = client("prefill"), client("decode")
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = pre.post(path, json=CHAT, headers=auth())
        assert r.status_code == 404 and "role is prefill" in r.json()["error"]["message"], r.text
    r = dec.post("/v1/kv/prefill", json={"prompt_token_ids": [1]}, headers=auth())
    assert r.status_code == 404 and "role is decode" in r.json()["error"]["message"]
    # What each does serve gets past the role (to the loading model's 503).
    assert pre.post("/v1/kv/prefill", json={"prompt_token_ids": [1]}, headers=auth()).status_code == 503
    assert dec.post("/v1/chat/completions", json=CHAT, headers=auth()).status_code == 503
    assert client("unified").post("/v1/kv/prefill", json={"prompt_token_ids": [1]}, headers=auth()).status_code == 503


def test_draining_is_for_the_internal_token_and_can_be_undone():
    c = client("unified")
    state = c.app.state.slofleet
    assert c.post("/v1/drain").status_code == 401
    assert c.post("/v1/drain", headers=auth("wrong")).status_code == 401
    r = c.post("/v1/drain", headers=auth())
    assert r.status_code == 200 and r.json() == {"draining": True, "in_flight": 0} and state.draining
    assert c.delete("/v1/drain", headers=auth()).json()["draining"] is False and not state.draining


def sse_events(lines) -> list[dict | str]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.slow
def test_a_drained_engine_finishes_its_streams_and_the_grace_period_ends_one_with_an_error(tmp_path):
    srv = Server("--grace-period", "3", "--drain-delay", "0.5", "--max-model-len", "4096", log=tmp_path / "s.log",
                 env={INTERNAL_TOKEN_ENV: INTERNAL_TOKEN})
    try:
        srv.wait_ready()
        model = httpx.get(srv.url + "/v1/models", headers=auth()).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120, headers=auth()) as c, c.stream("POST", srv.url + "/v1/completions",
                                                                       json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert c.post(srv.url + "/v1/drain").json()["in_flight"] == 1
            assert httpx.get(srv.url + "/ready").status_code == 503  # the router and the Service stop sending
            assert c.post(srv.url + "/v1/completions", json={**body, "stream": False}).status_code == 503
            events = sse_events([first, *lines])  # the open stream runs to its end
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        c = httpx.Client(timeout=120, headers=auth())
        c.delete(srv.url + "/v1/drain")
        assert httpx.get(srv.url + "/ready").status_code == 200

        long = {**body, "max_tokens": 3000}
        with c.stream("POST", srv.url + "/v1/completions", json=long) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
        # Cut just before the drain delay plus the grace period, in words the client can act on.
        assert 2.5 < time.monotonic() - t0 < 4.5
        assert "grace period ended" in events[-1]["error"]["message"], events[-3:]
        assert srv.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        srv.stop()
