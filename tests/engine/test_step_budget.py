"""The SLO-aware step budget without a model: while a bucket with a TPOT target decodes, a document's prefill chunks
are bounded to what the fitted step cost says fits in that target, yet the document progresses and gets the whole
budget once no such decode runs; bad per-bucket targets are refused, and the router's per-request target is taken
from the service's token holders only."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from slofleet.api.contract import TPOT_HEADER
from slofleet.engine.config import EngineConfig
from slofleet.engine.scheduler import MIN_PROMPT_CHUNK
from slofleet.engine.server.api import tpot_of
from slofleet.engine.step_cost import WINDOW

from .builders import make_request, make_scheduler, step

FIXED, PER_SEQ, PER_TOKEN = 0.010, 0.002, 0.0004  # the stand-in model's step cost, in seconds


def seconds(seqs: int, prompt_tokens: int) -> float:
    return FIXED + PER_SEQ * seqs + PER_TOKEN * prompt_tokens


def learnt():
    sched = make_scheduler(num_blocks=256)
    for i in range(WINDOW):  # steps of every shape, as a serving engine sees them
        seqs, prompt = 1 + i % 24, (i * 37) % 400
        sched.observe(seqs, prompt, seconds(seqs, prompt))
    return sched


def run_doc_beside_chats(sched, chats: int, tpot: float | None) -> list[tuple[int, int, bool]]:
    """(decodes, document tokens, chats decoding) per step until the document's prompt is computed; the chats
    target `tpot` (as LLMEngine.add_request gives them from --bucket-tpot-ms or the router's header)."""
    for i in range(chats):
        sched.add(make_request(8, max_tokens=200, bucket="chat", request_id=f"chat{i}", tpot=tpot))
    step(sched)  # the chats' prompts
    doc = make_request(1500, max_tokens=2, bucket="doc", request_id="doc")
    sched.add(doc)
    shapes = []
    while doc.num_computed_tokens < doc.num_prompt_tokens:
        out, _ = step(sched)
        decodes = sum(1 for r, n in out.scheduled if r is not doc)
        shapes.append((decodes, sum(n for r, n in out.scheduled if r is doc), any(r.bucket == "chat" for r in
                                                                                   sched.running)))
    return shapes


def test_a_document_chunk_fits_in_the_chats_tpot():
    shapes = run_doc_beside_chats(learnt(), chats=4, tpot=0.050)
    assert all(d == 4 for d, _, _ in shapes)
    for decodes, chunk, _ in shapes:
        assert MIN_PROMPT_CHUNK <= chunk or chunk == 1500 - sum(c for _, c, _ in shapes[:-1])
        assert seconds(decodes + 1, chunk) <= 0.050 * 1.02  # within the target, up to the fit's error
    assert max(c for _, c, _ in shapes) > 0.8 * (0.050 - FIXED - PER_SEQ * 5) / PER_TOKEN  # not needlessly small
    unbounded = run_doc_beside_chats(learnt(), chats=4, tpot=None)  # no target: the whole budget (512 less 4 decodes)
    assert max(c for _, c, _ in unbounded) == 508 and len(unbounded) < len(shapes)


def test_a_target_too_tight_for_any_prompt_still_lets_the_document_progress():
    shapes = run_doc_beside_chats(learnt(), chats=4, tpot=0.005)
    assert all(chunk >= MIN_PROMPT_CHUNK for _, chunk, _ in shapes[:-1])
    assert max(chunk for _, chunk, _ in shapes) == MIN_PROMPT_CHUNK


def test_an_engine_gives_each_bucket_its_target():
    cfg = EngineConfig(bucket_tpot_ms="chat=50, doc=400")
    assert cfg.bucket_tpot_map() == {"chat": 0.05, "doc": 0.4} and cfg.buckets() == {"chat", "doc"}


@pytest.mark.parametrize("bad", ["chat=0", "chat=-5", "chat=fast", "=50", "chat=inf"])
def test_bad_targets_are_refused(bad):
    with pytest.raises(ValueError, match="bucket_tpot_ms"):
        EngineConfig(bucket_tpot_ms=bad)


def request_with(tpot_ms: str, token: str, internal: bool) -> SimpleNamespace:
    """What tpot_of reads of a Starlette request: the app's settings, the auth result and the headers."""
    settings = SimpleNamespace(internal_token=token)
    return SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(slofleet=SimpleNamespace(settings=settings))),
                           state=SimpleNamespace(internal=internal), headers={TPOT_HEADER: tpot_ms})


def test_the_routers_target_is_honoured_from_token_holders_only():
    assert tpot_of(request_with("40", "tok", internal=True)) == 0.04
    assert tpot_of(request_with("40", "tok", internal=False)) is None  # a client calling an engine directly
    assert tpot_of(request_with("40", "", internal=False)) == 0.04  # a local engine without a service token
    for bad in ("0", "-3", "fast", "inf", "nan", ""):
        assert tpot_of(request_with(bad, "", internal=False)) is None, bad
