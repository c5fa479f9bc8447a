"""The engine's edges with a real server process: its API key, the names it answers to, the body size limit, and
bucket names as label values (bounded)."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

KEY = "sk-edge-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--api-key", KEY, "--served-model-name", "chat,chat-alias", "--max-request-bytes", "20000",
                 log=tmp_path_factory.mktemp("edges") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def post(server, body: dict, key: str | None = KEY, **headers) -> httpx.Response:
    auth = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/completions", json=body, headers={**auth, **headers}, timeout=60)


def test_api_key_guards_v1_but_not_probes(server):
    body = {"model": "chat", "prompt": "hi", "max_tokens": 1}
    assert post(server, body, key=None).status_code == 401
    r = post(server, body, key="sk-wrong")
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert post(server, body).status_code == 200
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200


def test_the_served_names_and_the_weights_name_are_answered_to(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["chat", "chat-alias", "SmolLM2-135M-Instruct"]
    for name in ("chat", "chat-alias", "SmolLM2-135M-Instruct"):
        out = client.completions.create(model=name, prompt="The capital of France is", max_tokens=2, temperature=0)
        assert out.model == "chat" and out.usage.completion_tokens == 2
    r = post(server, {"model": "default", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 400 and "'chat'" in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_413_before_parsing(server):
    r = post(server, {"model": "chat", "prompt": "word " * 5000, "max_tokens": 1})
    assert r.status_code == 413 and "larger than 20000 bytes" in r.json()["error"]["message"]
    # Without a content-length (chunked), the limit still holds while the body streams in.
    chunks = (b'{"model": "chat", "prompt": "' + b"x" * 4000 for _ in range(8))
    r = httpx.post(server.url + "/v1/completions", content=chunks, timeout=60,
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 413


def test_bucket_header_values_are_bounded_label_values(server):
    for i in range(36):
        assert post(server, {"model": "chat", "prompt": "hi", "max_tokens": 1},
                    **{"x-slofleet-bucket": f"tenant-{i}"}).status_code == 200
    assert post(server, {"model": "chat", "prompt": "hi", "max_tokens": 1},
                **{"x-slofleet-bucket": 'Evil" Label{}'}).status_code == 200
    text = httpx.get(server.url + "/metrics", timeout=10).text
    buckets = {line.split('bucket="', 1)[1].split('"', 1)[0] for line in text.splitlines()
               if line.startswith("vllm:e2e_request_latency_seconds_count")}
    tenants = {b for b in buckets if b.startswith("tenant-")}
    assert tenants == {f"tenant-{i}" for i in range(32)} and buckets - tenants == {"default", "other"}
