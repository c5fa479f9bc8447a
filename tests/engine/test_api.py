"""The OpenAI-compatible API through the real `openai` client against a real server process."""
from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Small limits so overload, context errors and preemption are reachable in a test.
    srv = Server("--max-num-seqs", "2", "--max-waiting-requests", "3", "--max-model-len", "512",
                 "--bucket-priorities", "chat=0,batch=5", log=tmp_path_factory.mktemp("api") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def wait_idle(server: Server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running{}"] == 0 and m["vllm:kv_cache_usage_perc{}"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine not idle: {m}"
        time.sleep(0.2)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200


def test_chat_answers_paris(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_non_stream_with_usage(client):
    kw = dict(model=MODEL, prompt="The three primary colours are", max_tokens=20, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_stop_string_never_streams_partially(client):
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    assert "Paris" in plain
    stopped = client.chat.completions.create(**kw, stop=["Paris"])
    assert stopped.choices[0].message.content == plain[:plain.index("Paris")]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kw, stop=["Paris"], stream=True) if c.choices)
    assert streamed == stopped.choices[0].message.content and "Par" not in streamed


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))  # greedy picks the top


def test_streamed_logprobs_are_those_of_the_whole_answer(client):
    """Tokens whose text is held back (a possible stop string, half a character) still bring their logprobs: the
    stream's logprobs are the non-streamed answer's, token for token, chat and completions alike."""
    kw = dict(model=MODEL, max_tokens=12, temperature=0, stop=["Paris"])
    whole = client.chat.completions.create(messages=QUESTION, logprobs=True, **kw)
    parts = [c.choices[0].logprobs.content for c in client.chat.completions.create(
        messages=QUESTION, logprobs=True, stream=True, **kw) if c.choices and c.choices[0].logprobs]
    assert [(t.token, t.logprob) for p in parts for t in p] == \
        [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]
    prompt = "The capital of France is"
    whole = client.completions.create(prompt=prompt, logprobs=1, **kw)
    parts = [c.choices[0].logprobs for c in client.completions.create(prompt=prompt, logprobs=1, stream=True, **kw)
             if c.choices and c.choices[0].logprobs]
    lp = whole.choices[0].logprobs
    assert [t for p in parts for t in p.tokens] == lp.tokens and lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


@pytest.mark.parametrize("kwargs, needle", [
    (dict(model="gpt-4"), "model 'gpt-4' is not served here"),
    (dict(temperature=-1), "temperature: must be in [0, 2]"),
    (dict(top_p=0), "top_p: must be in (0, 1]"),
    (dict(max_tokens=0), "max_tokens: must be >= 1"),
    (dict(n=0), "n: must be in [1, 128]"),
    (dict(logit_bias={"x": 1}), "logit_bias: keys must be token ids"),
    (dict(logit_bias={"50": 101}), "logit_bias: values must be numbers in [-100, 100]"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice names function 'g'"),
    (dict(tool_choice="required"), "tool_choice 'required' needs tools"),
    (dict(max_tokens=600), "exceeds the context of 512 tokens"),
])
def test_bad_input_is_400_with_message(client, kwargs, needle):
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=5) | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert needle in e.value.message


def test_prompt_longer_than_context(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 700, max_tokens=5)
    assert "shorten the prompt" in e.value.message


def test_malformed_json_and_unknown_field(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "temprature": 0.5})
    assert r.status_code == 400 and "temprature: unknown field" in r.json()["error"]["message"]


def test_overload_gets_429_with_retry_after(server):
    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            body = {"model": MODEL, "prompt": "Count slowly from one to one hundred:", "max_tokens": 12,
                    "ignore_eos": True}
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(12)])
    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    # At least the waiting limit (3) is admitted; how many more depends on how fast the engine moves
    # requests into its 2 running slots while the burst arrives. Nothing else is answered.
    assert codes.count(200) >= 3 and codes.count(429) >= 1 and codes.count(200) + codes.count(429) == 12, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert "overloaded" in refused.json()["error"]["message"]
    m = wait_idle(server)
    assert m["slofleet:admission_refusals_total{}"] >= codes.count(429)


def test_disconnect_frees_kv_blocks(server):
    before = server.metrics()["vllm:request_success_total{bucket=default,finished_reason=abort}"] \
        if "vllm:request_success_total{bucket=default,finished_reason=abort}" in server.metrics() else 0
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leave mid-stream: the connection closes here
    m = wait_idle(server)
    assert m["vllm:request_success_total{bucket=default,finished_reason=abort}"] == before + 1
    # The non-streaming path notices the disconnect too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.5)
    m = wait_idle(server)
    assert m["vllm:request_success_total{bucket=default,finished_reason=abort}"] == before + 2


def test_metrics_expose_contract(server, client):
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                   extra_headers={"x-slofleet-bucket": "chat"})
    m = wait_idle(server)
    names = {k.split("{")[0] for k in m}
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "slofleet:queued_prompt_tokens", "slofleet:kv_blocks_total", "slofleet:kv_blocks_free",
                 "slofleet:admission_refusals_total"]:
        assert name in names, name
    for hist in ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"]:
        assert m[f"{hist}_count{{bucket=chat}}"] >= 1, hist
    assert m["vllm:prefix_cache_queries_total{}"] > 0
    assert m["slofleet:kv_blocks_free{}"] == m["slofleet:kv_blocks_total{}"]


def test_sigterm_drains_in_flight_then_exits(tmp_path):
    srv = Server("--grace-period", "60", "--drain-delay", "3", log=tmp_path / "server.log")
    try:
        srv.wait_ready()
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            srv.proc.terminate()
            time.sleep(0.5)
            assert httpx.get(srv.url + "/ready").status_code == 503  # no longer admitting...
            refused = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            rest = [first] + [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"  # ...but the in-flight stream ran to its end
        assert '"finish_reason": "length"' in rest[-2]
        # It exits by itself (uvicorn re-raises the SIGTERM it deferred, so -15 is a clean exit too).
        assert srv.proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        srv.stop(signal.SIGKILL)
