"""vLLM's CPU build and llama.cpp's llama-server, started from `make install-runtimes`' cache, answer OpenAI chat and
completions (streaming too) and export the metrics docs/runtimes.md maps. One server per runtime per session;
each test is skipped, with the reason, where its runtime is not installed."""
from __future__ import annotations

import json
import socket

import httpx
import pytest

from slofleet.bench import runtimes
from slofleet.engine import loader

pytestmark = pytest.mark.slow

# Small: the tests send a handful of short requests on a shared machine.
SHAPE = runtimes.Shape(max_num_seqs=4, max_model_len=1024, kv_cache_gb=0.25)
METRICS = {runtimes.VLLM: ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                           "vllm:time_to_first_token_seconds_bucket"),
           runtimes.LLAMACPP: ("llamacpp:requests_processing", "llamacpp:requests_deferred",
                               "llamacpp:tokens_predicted_total")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(runtime: str, tmp_path_factory):
    if runtimes.find(runtime) is None:
        pytest.skip(runtimes.missing_reason(runtime))
    work = tmp_path_factory.mktemp(runtime)
    if runtime == runtimes.VLLM:
        from slofleet.engine.export import export_hf
        launch = runtimes.vllm(free_port(), export_hf("default", work / "hf", dtype=SHAPE.dtype), SHAPE)
    else:
        launch = runtimes.llamacpp(free_port(), loader.embedded_gguf(), SHAPE)
    proc = runtimes.start(launch, work / "server.log", timeout=900)
    yield launch
    runtimes.stop(proc)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    yield from serve(runtimes.VLLM, tmp_path_factory)


@pytest.fixture(scope="session")
def llamacpp_server(tmp_path_factory):
    yield from serve(runtimes.LLAMACPP, tmp_path_factory)


@pytest.fixture(params=[runtimes.VLLM, runtimes.LLAMACPP])
def server(request) -> runtimes.Launch:
    return request.getfixturevalue(f"{request.param}_server")


def test_chat_answers_with_text_and_usage(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": server.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
        "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"].strip()
    assert 0 < body["usage"]["completion_tokens"] <= 8


def test_streamed_completion_ends_with_done(server):
    chunks, text = [], ""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "model": server.model, "prompt": "The river runs", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    for c in chunks[:-1]:
        for choice in json.loads(c).get("choices", []):
            text += choice.get("text", "")
    assert text.strip() and len(chunks) >= 3


def test_metrics_export_the_mapped_names(server):
    httpx.post(server.url + "/v1/completions", timeout=120,
               json={"model": server.model, "prompt": "Hi", "max_tokens": 2})
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200
    missing = [m for m in METRICS[server.runtime] if m not in r.text]
    assert not missing, f"{server.runtime} /metrics lacks {missing}"


def test_models_lists_the_served_name(server):
    r = httpx.get(server.url + "/v1/models", timeout=30)
    assert r.status_code == 200
    assert server.model in [m["id"] for m in r.json()["data"]]
