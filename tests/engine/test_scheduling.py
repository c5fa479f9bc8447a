"""Scheduler policy on the real model: priority and bucket order, deadlines, admission limits."""
from __future__ import annotations

import time

import pytest

from slofleet.engine import AdmissionError, LLMEngine, SamplingParams

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


def test_priority_and_bucket_order_the_queue(engine):
    engine.add_request("first", P, "running")  # takes the only slot
    engine.step()
    engine.add_request("a", P, "batch-early", bucket="batch")  # bucket default priority 5
    engine.add_request("b", P, "chat-late", bucket="chat")  # priority 0
    engine.add_request("c", P, "explicit", priority=-1, bucket="batch")  # body priority overrides
    assert drain(engine) == ["running", "explicit", "chat-late", "batch-early"]


def test_deadline_expires_while_queued(engine):
    engine.add_request("busy", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "busy")
    engine.step()
    engine.add_request("late", P, "late", deadline_s=0.01)
    time.sleep(0.05)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    reasons = {o.request_id: o.finish_reason for o in outs}
    assert reasons == {"busy": "length", "late": "deadline"}
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


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


def test_chat_goes_ahead_of_a_long_prefill_in_progress():
    engine = LLMEngine(dtype="float32", max_num_batched_tokens=16, num_blocks=64)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    doc = engine.add_request(list(range(200, 300)), one, "doc", bucket="doc", priority=5)
    engine.step()  # the document's first 16-token chunk
    assert doc.num_computed_tokens == 16
    engine.add_request(list(range(400, 410)), one, "chat", priority=0)
    finished = [o.request_id for o in engine.step() if o.finished]
    assert finished == ["chat"]  # prefilled and answered in the very next step...
    # ...alone: the document's next chunk would only have made that step, and the chat's TTFT, longer
    assert doc.num_computed_tokens == 16
    engine.step()
    assert doc.num_computed_tokens == 32  # and the document goes on at full budget once the chat is out
    assert drain(engine) == ["doc"]
    assert engine.stats().steps.max_tokens_in_step <= 16
