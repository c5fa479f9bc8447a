"""Speculative decoding without a model: n-gram drafts, their share of the token budget and the KV pool, acceptance,
and the rollback of rejected drafts' blocks (never leaked, never in the prefix cache)."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from slofleet.engine.sampling_params import SamplingParams
from slofleet.engine.scheduler import MIN_PROMPT_CHUNK, Scheduler
from slofleet.engine.speculative import Speculator, propose

from .builders import finish, make_request, make_scheduler

CYCLE = [11, 12, 13, 14, 15]


def cycle_model(tokens: list[int]) -> int:
    """A stand-in model that continues CYCLE: n-gram drafts from a cyclic prompt are always right."""
    return CYCLE[(CYCLE.index(tokens[-1]) + 1) % len(CYCLE)] if tokens[-1] in CYCLE else CYCLE[0]


def wayward_model(tokens: list[int]) -> int:
    """Continues CYCLE but at every third position, where it says 99: drafts are partly right."""
    return 99 if len(tokens) % 3 == 0 else cycle_model(tokens)


def check_cache(sched: Scheduler) -> None:
    """Every cached block of a running request holds real, computed tokens (never a draft's), and no request holds
    a block past its tokens."""
    kv = sched.kv
    for req in sched.running:
        table = kv.tables.get(req.request_id, [])
        assert len(table) <= kv.blocks_needed(req.num_tokens), "blocks of rejected drafts kept"
        chain = kv.chain(req.token_ids())
        for i, block in enumerate(table):
            if block.block_hash is not None:
                assert (i + 1) * kv.block_size <= req.num_computed_tokens and block.block_hash == chain[i]


def spec_step(sched: Scheduler, spec: Speculator, model: Callable[[list[int]], int]):
    """One LLMEngine.step with drafts: propose, schedule, the stand-in model's pick at every row, accept, settle."""
    spec.propose(sched.running)
    out = sched.schedule()
    for req, n in out.scheduled:
        req.num_computed_tokens += n - len(req.draft)
    rows, reqs = spec.rows(out.scheduled)
    picks, i = [], 0
    while i < len(reqs):
        req, ctx = reqs[i], reqs[i].token_ids()
        picks += [model(ctx + req.draft[:j]) for j in range(1 + len(req.draft))]
        i += 1 + len(req.draft)
    assert len(picks) == len(rows)
    reqs, kept, _ = spec.accept(reqs, picks, [None] * len(picks))
    for req, toks in zip(reqs, kept):
        for tok in toks:
            req.output_token_ids.append(tok)
            if len(req.output_token_ids) >= req.max_tokens:
                finish(sched, req)
                break
    spec.settle(sched.kv, reqs)
    check_cache(sched)
    return out


def run(sched: Scheduler, spec: Speculator, model, reqs) -> int:
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_work():
        spec_step(sched, spec, model)
        steps += 1
    return steps


def test_propose_takes_what_followed_the_latest_earlier_match():
    tokens = [5, 6, 7, 1, 2, 9, 9, 1, 2, 8, 3, 1, 2]
    assert propose(tokens, 2, 3) == [8, 3, 1]
    assert propose(tokens, 2, 9) == [8, 3, 1, 2]  # up to the end
    assert propose(tokens, 3, 3) == []  # [3, 1, 2] occurs only at the end
    assert propose([1, 2], 2, 3) == [] and propose(tokens, 2, 0) == []


def test_propose_ignores_byte_matches_across_tokens():
    # [1, 2]'s bytes (little-endian int32) appear inside [2**24, 2**25, 0] at a byte offset that is no token's start
    assert propose([2**24, 2**25, 0, 7, 1, 2], 2, 2) == []
    assert propose([2**24, 2**25, 0, 1, 2, 7, 1, 2], 2, 2) == [7, 1]


@pytest.mark.parametrize("model", [cycle_model, wayward_model])
def test_drafts_give_the_same_tokens_in_fewer_steps_and_free_every_block(model):
    outs = {}
    for k in (0, 4):
        sched = make_scheduler(num_blocks=32, block_size=4)
        spec = Speculator(k, 2)
        reqs = [make_request(CYCLE * 3, max_tokens=23), make_request(CYCLE * 2 + [11], max_tokens=17)]
        steps = run(sched, spec, model, reqs)  # check_cache after every step
        outs[k] = steps, [r.output_token_ids for r in reqs], spec.stats
        assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
    (plain_steps, plain, _), (spec_steps, drafted, stats) = outs[0], outs[4]
    assert drafted == plain and [len(t) for t in plain] == [23, 17]
    if model is cycle_model:
        assert spec_steps <= plain_steps / 3
        # after the first token: 4 steps of 5 (4 drafted + 1), then a draft cut to the 1 that max_tokens leaves;
        # and 3 steps of 5, then one token without a draft
        assert stats.drafted["default"] == stats.accepted["default"] == 17 + 12 and stats.drafts["default"] == 5 + 3
    else:
        assert spec_steps < plain_steps and 0 < stats.accepted["default"] < stats.drafted["default"]


def test_a_draft_gets_only_budget_the_decodes_leave():
    sched = make_scheduler(num_blocks=64, block_size=4)
    spec = Speculator(4, 2)
    reqs = [make_request(CYCLE * 2, max_tokens=10) for _ in range(4)]
    for r in reqs:
        sched.add(r)
    spec_step(sched, spec, cycle_model)  # all four prefill in one step
    sched.config.max_num_batched_tokens = 6
    out = spec_step(sched, spec, cycle_model)
    assert [n for _, n in out.scheduled] == [3, 1, 1, 1]


def test_a_draft_never_preempts():
    # 2 requests of 8 tokens (no block in common) fill 4 blocks of 4; each one's next token needs a third block: 6
    # exist, so a draft's block would have to come from the other's
    sched = make_scheduler(num_blocks=6, block_size=4)
    spec = Speculator(4, 2)
    reqs = [make_request(CYCLE + CYCLE[:3], max_tokens=10), make_request(CYCLE[1:] + CYCLE[:4], max_tokens=10)]
    for r in reqs:
        sched.add(r)
    spec_step(sched, spec, cycle_model)
    out = spec_step(sched, spec, cycle_model)
    assert not out.preempted and [n for _, n in out.scheduled] == [1, 1]
    for r in reqs:
        finish(sched, r)
    assert sched.kv.pool.num_free == 6


def test_who_drafts():
    spec = Speculator(4, 2, buckets="chat")
    reqs = {name: make_request(CYCLE * 2, max_tokens=10, bucket="chat") for name in
            ("greedy", "sampled", "penalised", "min_tokens", "last_token", "other_bucket")}
    reqs["sampled"].params = SamplingParams(temperature=0.7)
    reqs["penalised"].params = SamplingParams(temperature=0, repetition_penalty=1.2)
    reqs["min_tokens"].params = SamplingParams(temperature=0, min_tokens=3)
    reqs["last_token"].max_tokens = 1
    reqs["other_bucket"].bucket = "doc"
    for r in reqs.values():
        r.num_computed_tokens = r.num_tokens - 1
    spec.propose(list(reqs.values()))
    assert {n for n, r in reqs.items() if r.draft} == {"greedy"} and reqs["greedy"].draft == [11, 12, 13, 14]
    reqs["greedy"].max_tokens = 2  # room for one draft token and the bonus
    spec.propose([reqs["greedy"]])
    assert reqs["greedy"].draft == [11]


def test_finishing_a_drafted_request_frees_its_draft_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4)
    spec = Speculator(4, 2)
    req = make_request(CYCLE * 2, max_tokens=10)
    sched.add(req)
    spec_step(sched, spec, cycle_model)
    spec.propose(sched.running)
    sched.schedule()
    assert len(sched.kv.tables[req.request_id]) == 4  # 11 tokens' KV with the draft's 4 slots: 15 of 16
    finish(sched, req)  # an abort between schedule and sampling
    assert sched.kv.pool.num_free == 16


def test_a_rejected_draft_shortens_the_next_one_and_matches_lengthen_it():
    spec = Speculator(4, 2)
    req = make_request(CYCLE * 3, max_tokens=20)
    req.num_computed_tokens = req.num_tokens - 1
    lengths = []
    for picks_right in (0, 1, 2, 3, 4):  # how many of the draft's tokens the stand-in model agrees with
        spec.propose([req])
        lengths.append(len(req.draft))
        picks = req.draft[:picks_right] + [99] * (len(req.draft) + 1 - picks_right)
        spec.accept([req] * len(picks), picks, [None] * len(picks))
        req.draft = []
    assert lengths == [4, 1, 2, 3, 4]


def test_draft_tokens_come_out_of_a_tpot_bounded_prompt_budget():
    sched = make_scheduler()
    decodes = [make_request(8, max_tokens=10) for _ in range(4)]
    for r in decodes:
        r.tpot, r.draft = 0.1, [1, 2]
    assert sched.prompt_budget(512, decodes) == MIN_PROMPT_CHUNK  # nothing learnt yet: small chunks
    for seqs in range(1, 49):  # exact costs: 10 ms a step, 1 ms a sequence, 0.2 ms a prompt token
        for prompt in (0, 64, 256):
            sched.cost.observe(seqs, prompt, 0.010 + 0.001 * seqs + 0.0002 * prompt)
    for r in decodes:
        r.draft = []
    plain = sched.prompt_budget(512, decodes)
    for r in decodes:
        r.draft = [1, 2, 3, 4]
    assert 100 < plain < 512 and sched.prompt_budget(512, decodes) == plain - 16
