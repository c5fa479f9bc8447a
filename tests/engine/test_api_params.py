"""n, best_of, logit_bias, echo, /v1/responses and /v1/embeddings through the openai client against one real
`slofleet serve` process (issue 54)."""
from __future__ import annotations

import time

import httpx
import numpy as np
import openai
import pytest

from slofleet.engine import loader
from tests.support.server import serving

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Say hi to me."}]
COMPUTED = "slofleet:prompt_tokens_computed_total{}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("params") / "s.log"
    with serving("--max-model-len", "512", "--max-num-seqs", "8", log=log) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_n3_chat_gives_three_indexed_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, n=3, max_tokens=6, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # seeds 5, 6, 7 sample differently
    assert 3 <= r.usage.completion_tokens <= 18 and r.usage.prompt_tokens < r.usage.completion_tokens + 40
    again = client.chat.completions.create(model=MODEL, messages=HI, n=3, max_tokens=6, seed=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_n4_costs_one_prefill(server, client):
    prompt = "A long and fresh prompt about lighthouses, harbors and the ships that pass them at night " * 2
    before = server.metrics()[COMPUTED]
    r = client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=4, temperature=1.0)
    computed = server.metrics()[COMPUTED] - before
    assert len(r.choices) == 4 and computed == r.usage.prompt_tokens  # one prefill, not four


def test_n2_stream_interleaves_choices_by_index(client):
    stream = client.chat.completions.create(model=MODEL, messages=HI, n=2, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    texts, usage = {}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        usage = chunk.usage or usage
    greedy = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    assert texts == {0: greedy.choices[0].message.content, 1: greedy.choices[0].message.content}
    assert usage.completion_tokens == 2 * greedy.usage.completion_tokens


def test_logit_bias_changes_greedy_output_as_asked(client):
    tokenizer = loader.load_tokenizer(loader.resolve("default"))
    green = tokenizer.encode(" green", add_special_tokens=False)
    assert len(green) == 1
    kw = dict(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    forced = client.completions.create(**kw, logit_bias={str(green[0]): 100}).choices[0].text
    assert plain != " green green green" and forced == " green green green"
    banned = {str(t): -100 for t in tokenizer.encode(plain, add_special_tokens=False)}
    assert not client.completions.create(**kw, logit_bias=banned).choices[0].text.startswith(plain.split()[0])


def test_echo_and_best_of(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, echo=True, temperature=0)
    assert r.choices[0].text.startswith("The sky is") and len(r.choices[0].text) > len("The sky is")
    best = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, n=2, best_of=4, logprobs=0,
                                     seed=3)
    scores = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert [c.index for c in best.choices] == [0, 1] and scores == sorted(scores, reverse=True)
    quiet = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, n=2, best_of=4, seed=3)
    assert [c.text for c in quiet.choices] == [c.text for c in best.choices] and quiet.choices[0].logprobs is None


@pytest.mark.parametrize("extra, needle", [
    ({"use_beam_search": True}, "use_beam_search (beam search"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1}, "echo with logprobs"), ({"best_of": 3, "stream": True}, "best_of with stream")])
def test_refused_by_name_with_400(server, extra, needle):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2} | extra)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_responses_plain_and_streamed(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.output[0].type == "message" and r.output_text
    assert r.usage.output_tokens > 0 and r.status in ("completed", "incomplete")
    events = list(client.responses.create(model=MODEL, max_output_tokens=12, temperature=0, stream=True,
                                          input=[{"role": "user", "content": [
                                              {"type": "input_text", "text": "What is the capital of France?"}]}]))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == f"response.{r.status}" and [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


@pytest.mark.parametrize("extra, needle", [({"store": True}, "store"), ({"previous_response_id": "r1"},
                                                                            "previous_response_id")])
def test_responses_refuse_state(client, extra, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        client.responses.create(model=MODEL, input="hi", **extra)


def test_embeddings(client, server):
    texts = ["The cat sat on the mat.", "A cat was sitting on the rug.", "Quarterly revenue grew five percent."]
    e = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    v = np.array([d.embedding for d in e.data])
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-4)
    assert v[0] @ v[1] > v[0] @ v[2]
    f = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    assert np.allclose(f.data[0].embedding, v[0], atol=1e-5) and e.usage.prompt_tokens > 0
    r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "x", "dimensions": 8})
    assert r.status_code == 400 and "dimensions" in r.json()["error"]["message"]


def test_leaving_mid_stream_frees_every_sample(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "n": 3, "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # started; then leave
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running{}"] == 0 and m["vllm:kv_cache_usage_perc{}"] == 0:
            break
        assert time.monotonic() < deadline, f"samples still held: {m}"
        time.sleep(0.2)
