"""Scheduler policy without a model: priority and bucket order, deadlines, admission limits, one token budget
shared by decodes and prefill chunks, preemption by recompute, prefix-cache hits, block accounting."""
from __future__ import annotations

import random
import time

import pytest

from slofleet.engine import AdmissionError
from slofleet.engine.scheduler import STARVATION_S

from .builders import drain, finish, make_request, make_scheduler, run, step


def queue_scheduler():
    # One sequence slot, so everything after the first request queues.
    return make_scheduler(max_num_seqs=1, max_waiting_requests=4, max_queued_tokens=60,
                          bucket_priorities="chat=0,batch=5")


def test_priority_and_bucket_order_the_queue():
    sched = queue_scheduler()
    prio = sched.config.bucket_priority_map()  # what LLMEngine.add_request gives a request without its own
    sched.add(make_request(5, request_id="running"))  # takes the only slot
    step(sched)
    sched.add(make_request(5, request_id="batch-early", bucket="batch", priority=prio["batch"]))
    sched.add(make_request(5, request_id="chat-late", bucket="chat", priority=prio["chat"]))
    sched.add(make_request(5, request_id="explicit", bucket="batch", priority=-1))  # body priority overrides
    assert drain(sched) == ["running", "explicit", "chat-late", "batch-early"]


def test_deadline_expires_while_queued():
    sched = queue_scheduler()
    sched.add(make_request(5, max_tokens=20, request_id="busy"))
    step(sched)
    late = make_request(5, request_id="late", deadline_s=0.01)
    sched.add(late)
    time.sleep(0.05)
    done, _ = run(sched)
    assert dict(done) == {"busy": "length", "late": "deadline"}
    assert late.num_computed_tokens == 0 and not late.output_token_ids
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks


def test_admission_limits():
    sched = queue_scheduler()
    with pytest.raises(AdmissionError, match="prompt tokens already queued"):
        sched.check_admission(70)  # 70 tokens > max_queued_tokens=60
    for i in range(4):
        sched.check_admission(2)
        sched.add(make_request(2, request_id=f"w{i}"))
    with pytest.raises(AdmissionError, match="4 requests already waiting") as refused:
        sched.check_admission(2)
    assert refused.value.retry_after >= 1 and sched.admission_refusals == 2
    assert len(drain(sched)) == 4


def test_requests_not_yet_queued_count_against_the_limits():
    # LLMEngine.add_request passes its inbox as pending: those requests are waiting too.
    with pytest.raises(AdmissionError, match="4 requests already waiting"):
        queue_scheduler().check_admission(2, pending=4)
    sched = queue_scheduler()
    sched.add(make_request(20))
    with pytest.raises(AdmissionError, match="50 prompt tokens already queued"):
        sched.check_admission(11, pending=1, pending_tokens=30)
    sched.check_admission(10, pending=1, pending_tokens=30)  # exactly at the limit


def test_chat_goes_ahead_of_a_long_prefill_in_progress():
    sched = make_scheduler(max_num_batched_tokens=16)
    doc = make_request(100, max_tokens=1, request_id="doc", bucket="doc", priority=5)
    sched.add(doc)
    first, _ = step(sched)  # the document's first 16-token chunk
    assert doc.num_computed_tokens == 16
    chat = make_request(10, max_tokens=1, request_id="chat", priority=0)
    sched.add(chat)
    out, done = step(sched)
    assert [rid for rid, _ in done] == ["chat"]  # prefilled and answered in the very next step...
    # ...alone: the document's next chunk would only have made that step, and the chat's TTFT, longer
    assert out.scheduled == [(chat, 10)] and doc.num_computed_tokens == 16
    step(sched)
    assert doc.num_computed_tokens == 32  # and the document goes on at full budget once the chat is out
    done, outs = run(sched)
    assert [rid for rid, _ in done] == ["doc"]
    assert max(o.num_tokens for o in [first, out, *outs]) <= 16


def test_decodes_come_first_and_a_prefill_chunk_takes_the_rest_of_the_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b = make_request(4, max_tokens=10, priority=0), make_request(4, max_tokens=10, priority=0)
    sched.add(a)
    sched.add(b)
    assert step(sched)[0].scheduled == [(a, 4), (b, 4)]  # both prompts in one step: one priority
    doc = make_request(100, max_tokens=1, priority=5)
    sched.add(doc)
    out, _ = step(sched)
    # Decodes are not prompt work: a less urgent prefill still shares their step, within the one budget.
    assert out.scheduled == [(a, 1), (b, 1), (doc, 14)] and out.num_tokens == 16


def test_prompt_work_of_two_priorities_never_shares_a_step():
    sched = make_scheduler(max_num_batched_tokens=64)
    doc, chat = make_request(100, max_tokens=2, priority=5), make_request(10, max_tokens=2, priority=0)
    sched.add(doc)
    sched.add(chat)
    assert step(sched)[0].scheduled == [(chat, 10)]  # 54 tokens of budget left unused
    assert step(sched)[0].scheduled == [(chat, 1), (doc, 63)]


def test_max_num_seqs_caps_the_running_batch():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(4) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    out, _ = step(sched)
    assert [r for r, _ in out.scheduled] == reqs[:2] and sched.running == reqs[:2] and sched.waiting == reqs[2:]
    assert drain(sched) == [r.request_id for r in reqs]


def test_preemption_by_recompute_when_the_pool_runs_short():
    # 4 blocks of 4 tokens; each request grows to 12 tokens (3 blocks): both cannot fit.
    sched = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    hi = make_request(4, max_tokens=8, priority=0, request_id="hi", bucket="chat")
    lo = make_request(4, max_tokens=8, priority=5, request_id="lo", bucket="batch")
    sched.add(hi)
    sched.add(lo)
    for _ in range(10):
        out, _ = step(sched)
        assert sched.kv.pool.num_free + sched.kv.pool.num_used == sched.kv.pool.num_blocks
        if out.preempted:
            break
    # The lowest-priority running request gives its blocks back and starts over, keeping what it generated.
    assert out.preempted == [lo] and lo in sched.waiting and lo.num_computed_tokens == 0
    assert sched.kv.block_table("lo") == [] and len(lo.output_token_ids) == 4
    assert sched.preemptions_by_bucket == {"batch": 1}
    done, outs = run(sched)
    assert [rid for rid, _ in done] == ["hi", "lo"]
    assert (lo, 8) in outs[2].scheduled  # once hi is done: its prompt and 4 outputs recomputed in one step
    assert len(hi.output_token_ids) == 8 and len(lo.output_token_ids) == 8
    assert sched.kv.pool.num_free == 4


@pytest.mark.parametrize("prompt_len, cached", [(10, 8), (8, 4)])
def test_prefix_cache_hits_are_not_computed_again(prompt_len, cached):
    sched = make_scheduler(block_size=4)
    prompt = list(range(500, 500 + prompt_len))
    sched.add(make_request(prompt, max_tokens=1))
    drain(sched)  # its full blocks stay cached after it finishes
    again = make_request(prompt, max_tokens=1)
    sched.add(again)
    out, _ = step(sched)
    # Whole blocks only, and never the last prompt token: its logits sample the first output token.
    assert again.num_cached_tokens == cached and out.scheduled == [(again, prompt_len - cached)]
    assert sched.kv.stats.hits == cached and sched.kv.stats.queries == 2 * prompt_len


def test_no_block_leaks_under_random_load_with_preemption_and_aborts():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=24, max_num_seqs=6)
    pool, live = sched.kv.pool, []
    for _ in range(400):
        if rng.random() < 0.3:
            shared = [7] * rng.choice([0, 4, 8])  # some prompts share a prefix: cache hits, shared blocks
            r = make_request(shared + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))],
                             max_tokens=rng.randrange(1, 20), priority=rng.choice([0, 5]))
            sched.add(r)
            live.append(r)
        live = [r for r in live if not r.finished]
        if live and rng.random() < 0.05:
            finish(sched, live.pop(rng.randrange(len(live))))  # an abort, running or waiting
        step(sched)
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert sum(len(t) for t in sched.kv.tables.values()) >= pool.num_used  # shared blocks counted per table
    assert sched.preemptions_by_bucket and sched.kv.stats.hits > 0
    run(sched)
    assert pool.num_free == pool.num_blocks and not sched.kv.tables


def test_a_request_starved_by_more_urgent_ones_runs_in_bounded_time():
    sched = make_scheduler(max_num_batched_tokens=16)
    old = make_request(16, priority=100, request_id="old")
    old.arrival_time -= STARVATION_S + 1  # queued long ago, behind a steady flow of chats
    sched.add(old)
    sched.add(make_request(16, priority=0, request_id="chat"))
    out, _ = step(sched)
    assert [r.request_id for r, _ in out.scheduled] == ["old"]
    fresh = make_scheduler(max_num_batched_tokens=16)  # the same two, neither starved: priority decides
    fresh.add(make_request(16, priority=100, request_id="old"))
    fresh.add(make_request(16, priority=0, request_id="chat"))
    out, _ = step(fresh)
    assert [r.request_id for r, _ in out.scheduled] == ["chat"]
