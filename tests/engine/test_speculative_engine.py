"""Speculative decoding with the real model: the same greedy tokens, text, stops, logprobs and finish reasons with
n-gram drafts on and off, acceptance counted per bucket and exported, and every KV block back after each run."""
from __future__ import annotations

import openai
import pytest

from slofleet.engine import LLMEngine
from slofleet.engine.sampling_params import SamplingParams
from slofleet.engine.server.collector import EngineCollector
from tests.support.server import Server

pytestmark = pytest.mark.slow

DOC = ("The committee met on Tuesday to review the budget for the new library, which includes a reading room, a "
       "children's corner and a small cafe near the entrance. The quick brown fox jumps over the lazy dog. ")
REPETITIVE = [f"Repeat the following text exactly, twice:\n{DOC}\nRepeated text:",
              "Count from 1 to 40, separated by commas: 1, 2, 3,",
              "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"]


@pytest.fixture(scope="module")
def engines():
    return {k: LLMEngine(dtype="float32", num_blocks=256, num_speculative_tokens=k, speculative_ngram=3)
            for k in (0, 4)}


def generate(engine: LLMEngine, prompts: list, params: list[SamplingParams], bucket: str = "default",
             steps: list | None = None) -> list:
    """(token ids, text joined from the deltas, finish reason, logprobs) per prompt; every block free after. steps:
    gets each step's record."""
    reqs = [engine.add_request(p, sp, bucket=bucket) for p, sp in zip(prompts, params)]
    texts = {r.request_id: "" for r in reqs}
    while engine.has_unfinished():
        for out in engine.step():
            assert len(out.new_logprobs) == (len(out.new_token_ids) if out.request.params.logprobs else 0)
            texts[out.request_id] += out.new_text
        if steps is not None:
            steps.append(engine.last_step)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    return [(r.output_token_ids, texts[r.request_id], r.finish_reason, r.output_logprobs) for r in reqs]


def both(engines, prompts, params, bucket="default"):
    return [generate(engines[k], prompts, params, bucket) for k in (0, 4)]


def test_greedy_tokens_are_the_same_with_drafts_and_accepted_ones_are_exported(engines, chat_ids):
    prompts = REPETITIVE + chat_ids
    params = [SamplingParams(temperature=0, max_tokens=48)] * len(prompts)
    off = generate(engines[0], prompts, params, bucket="docs")
    steps: list = []
    on = generate(engines[4], prompts, params, bucket="docs", steps=steps)
    for (a, ta, fa, _), (b, tb, fb, _) in zip(off, on):
        assert (a, ta, fa) == (b, tb, fb)
    assert any(s.num_generated > s.num_requests for s in steps)  # several tokens for some request in one step
    spec = engines[4].stats().spec
    assert spec.accepted["docs"] > 0 and spec.drafted["docs"] >= spec.accepted["docs"] and spec.drafts["docs"] > 0
    assert not engines[0].stats().spec.drafted
    families = {f.name: f for f in EngineCollector(engines[4]).collect()}
    sample = next(s for s in families["slofleet:spec_accepted_tokens"].samples if s.labels["bucket"] == "docs")
    assert sample.name == "slofleet:spec_accepted_tokens_total" and sample.value == spec.accepted["docs"]


def test_stops_lengths_and_logprobs_are_the_same_with_drafts(engines, tokenizer):
    prompt = REPETITIVE[0]
    (ids, text, _, _), = generate(engines[0], [prompt], [SamplingParams(temperature=0, max_tokens=40)])
    word = text.split()[12]  # a stop string well inside the repeated text, where drafts are accepted
    params = [SamplingParams(temperature=0, max_tokens=40, stop=[word]),
              SamplingParams(temperature=0, max_tokens=40, stop=[word], include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[20]]),
              SamplingParams(temperature=0, max_tokens=7),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=10, logprobs=3),
              SamplingParams(temperature=0.8, seed=5, max_tokens=20)]  # sampled: decodes without drafts
    off, on = both(engines, [prompt] * len(params), params)
    for (a, ta, fa, la), (b, tb, fb, lb) in zip(off, on):
        assert (a, ta, fa) == (b, tb, fb)
        assert [sorted(x) for x in la] == [sorted(y) for y in lb]
        assert all(abs(x[t] - y[t]) < 1e-3 for x, y in zip(la, lb) for t in x)
    cut = text.index(word)
    assert (on[0][1], on[1][1], on[0][2]) == (text[:cut], text[:cut + len(word)], "stop")
    assert len(on[3][0]) == 7 and on[3][2] == "length" and len(on[4][3]) == len(on[4][0])


def test_blocks_of_accepted_drafts_are_cached_with_their_own_kv(engines):
    # The second prompt is the first plus its output: its cached blocks include ones that accepted drafts filled,
    # and the continuation computed over them is the one speculation off computes over its own.
    accepted = engines[4].stats().spec.accepted.get("default", 0)
    first = generate(engines[4], [REPETITIVE[0]], [SamplingParams(temperature=0, max_tokens=40)])[0][0]
    assert engines[4].stats().spec.accepted["default"] > accepted
    ids = engines[4].tokenize(REPETITIVE[0]) + first
    params = [SamplingParams(temperature=0, max_tokens=16)]
    hits = engines[4].kv.stats.hits
    off, on = both(engines, [ids], params)
    assert engines[4].kv.stats.hits - hits >= len(ids) // 16 * 16 - 16 and off[0][:3] == on[0][:3]


def test_an_abort_mid_draft_frees_every_block(engines):
    engine = engines[4]
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=200)) for p in REPETITIVE]
    while not all(len(r.output_token_ids) > 5 for r in reqs):
        engine.step()
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    assert all(r.finish_reason == "abort" for r in reqs)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_the_server_streams_drafted_tokens_as_it_answers_without_them(engines, tmp_path):
    (ids, text, _, _), = generate(engines[0], [REPETITIVE[0]], [SamplingParams(temperature=0, max_tokens=40)])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    want = text[:text.index(stop)]
    srv = Server("--num-speculative-tokens", "4", log=tmp_path / "server.log")
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="SmolLM2-135M-Instruct", prompt=REPETITIVE[0], max_tokens=40, temperature=0, stop=[stop],
                  logprobs=2)
        assert client.completions.create(**kw).choices[0].text == want
        chunks = [c for c in client.completions.create(**kw, stream=True, stream_options={"include_usage": True})]
        streamed = [c.choices[0] for c in chunks if c.choices]
        assert "".join(c.text for c in streamed) == want and streamed[-1].finish_reason == "stop"
        assert len(streamed) < chunks[-1].usage.completion_tokens  # deltas of several tokens
        assert srv.metrics()["slofleet:spec_accepted_tokens_total{bucket=default}"] > 0
    finally:
        srv.stop()
