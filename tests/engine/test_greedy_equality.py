"""Greedy output equals transformers generate() token for token, in every engine configuration."""
from __future__ import annotations

import pytest

from slofleet.engine import LLMEngine, SamplingParams

from .conftest import assert_matches_reference

pytestmark = pytest.mark.slow

MAX_NEW = 24


def run(engine: LLMEngine, prompts: list[list[int]], max_new: int = MAX_NEW):
    params = SamplingParams(temperature=0, max_tokens=max_new, logprobs=5)
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert all(r.finished for r in reqs)
    return reqs


def check(engine, prompts, reference, max_new=MAX_NEW):
    reqs = run(engine, prompts, max_new)
    for req in reqs:
        ref, ref_lps = reference.greedy(req.prompt_token_ids, max_new)
        assert_matches_reference(req.output_token_ids, req.output_logprobs, ref, ref_lps)
    # Nothing leaks: every block is back in the pool.
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    return reqs


def make(**kw) -> LLMEngine:
    return LLMEngine(dtype="float32", **kw)


def test_eight_mixed_prompts_together(chat_ids, reference):
    engine = make()
    reqs = check(engine, chat_ids, reference)
    assert engine.stats().steps.steps < len(chat_ids) * MAX_NEW  # batched, not one by one
    assert len({r.num_prompt_tokens for r in reqs}) >= 6  # mixed lengths


@pytest.mark.parametrize("budget, caching", [(1, False), (7, True), (64, False), (64, True), (4096, False)])
def test_chunked_prefill_budgets(chat_ids, reference, budget, caching):
    engine = make(max_num_batched_tokens=budget, enable_prefix_caching=caching)
    check(engine, chat_ids[:3], reference, max_new=8)
    assert engine.stats().steps.max_tokens_in_step <= budget
    if budget < max(len(p) for p in chat_ids[:3]):
        assert engine.stats().steps.steps > 8  # prompts really were split into chunks


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching(chat_ids, reference, caching):
    engine = make(enable_prefix_caching=caching, block_size=8)
    prompts = chat_ids[:3]
    check(engine, prompts, reference, max_new=8)
    computed_first = engine.stats().steps.prompt_tokens_computed
    check(engine, prompts, reference, max_new=8)  # the same prompts again
    computed_second = engine.stats().steps.prompt_tokens_computed - computed_first
    if caching:
        assert engine.kv.stats.hits > 0
        assert computed_second < computed_first
        assert computed_second >= len(prompts)  # a fully cached prompt still computes its last token
    else:
        assert engine.kv.stats.hits == 0
        assert computed_second == computed_first


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(chat_ids, reference, block_size):
    engine = make(block_size=block_size)
    check(engine, chat_ids[2:5], reference, max_new=12)


def test_preemption_by_recompute(chat_ids, reference):
    prompts = chat_ids[:4]
    need = max(len(p) for p in prompts) + MAX_NEW
    # Room for about two requests at a time: the others are preempted and recomputed.
    engine = make(block_size=8, num_blocks=2 * (-(-need // 8)) + 1, enable_prefix_caching=False)
    check(engine, prompts, reference)
    assert engine.stats().preemptions > 0


def test_offline_llm_takes_longer_prefill_steps(chat_ids, reference):
    from slofleet.engine import LLM
    from slofleet.engine.llm import OFFLINE_BATCHED_TOKENS
    llm = LLM(dtype="float32")
    prompts = [a + b for a, b in zip(chat_ids, chat_ids[1:] + chat_ids[:1])]  # more tokens than 512, all distinct
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, logprobs=5))
    steps = llm.engine.stats().steps
    assert 512 < steps.max_tokens_in_step <= OFFLINE_BATCHED_TOKENS
    for prompt, out in zip(prompts, outs):
        assert_matches_reference(out.token_ids, out.logprobs, *reference.greedy(prompt, 4))
    assert LLM(dtype="float32", max_num_batched_tokens=64).engine.config.max_num_batched_tokens == 64
