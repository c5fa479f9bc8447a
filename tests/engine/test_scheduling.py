"""The engine's side of scheduling, on the real model (an LLMEngine loads its weights): add_request gives a
request its bucket's priority unless it brings its own, turns deadline_s into a deadline that finishes it as
"deadline", counts requests still in its inbox against the admission limits, and refuses one that could never
fit. The policy itself (order, budgets, chunks, preemption) is tested without a model in test_scheduler.py."""
from __future__ import annotations

import time

import pytest

from slofleet.engine import AdmissionError, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

P = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(dtype="float32", max_num_seqs=1, max_waiting_requests=4, max_queued_tokens=60,
                     bucket_priorities="chat=0,batch=5", num_blocks=64)


def drain(engine) -> list[str]:
    order = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
    return order


def test_bucket_priority_unless_the_request_brings_one(engine):
    assert engine.add_request("a", P, "batch-early", bucket="batch").priority == 5  # the bucket's default
    assert engine.add_request("b", P, "chat-late", bucket="chat").priority == 0
    assert engine.add_request("c", P, "explicit", priority=-1, bucket="batch").priority == -1  # body overrides
    assert drain(engine) == ["explicit", "chat-late", "batch-early"]


def test_deadline_expires_while_queued(engine):
    late = engine.add_request("late", P, "late", deadline_s=0.01)
    assert 0 < late.deadline - time.monotonic() <= 0.01
    time.sleep(0.05)
    outs = engine.step()  # expired before anything is computed for it
    assert [(o.request_id, o.finish_reason) for o in outs] == [("late", "deadline")]
    assert not engine.has_unfinished() and engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_admission_limits(engine):
    with pytest.raises(AdmissionError, match="prompt tokens already queued"):
        engine.add_request(list(range(100, 170)), P)  # 70 tokens > max_queued_tokens=60
    for i in range(4):
        engine.add_request("hello", P, f"w{i}")
    with pytest.raises(AdmissionError, match="4 requests already waiting"):
        engine.add_request("hello", P)
    drain(engine)


def test_request_that_can_never_fit_is_refused(engine):
    with pytest.raises(ValueError, match="lower max_tokens"):
        engine.add_request("hello", SamplingParams(max_tokens=64 * 16))
