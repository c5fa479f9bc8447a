"""KV hand-off in the engine core: a decode engine continues from a prefill engine's exported blocks."""
from __future__ import annotations

import pytest

from slofleet.engine import LLMEngine, SamplingParams
from slofleet.engine.errors import UpstreamError
from slofleet.engine.kv_transfer import KVPayload

pytestmark = pytest.mark.slow

P = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    kw = dict(dtype="float32", num_blocks=96, block_size=16)
    return LLMEngine(role="prefill", **kw), LLMEngine(role="decode", **kw)


def finish(engine, req):
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == req.request_id]
    return outs


def prefill(engine, ids) -> KVPayload:
    req = engine.add_request(ids, P, export_kv=True)
    out = finish(engine, req)[-1]
    assert out.finished and out.kv is not None
    return KVPayload.from_bytes(out.kv.to_bytes())  # through the wire format


def test_decode_continues_from_transferred_kv(engines, chat_ids):
    pre, dec = engines
    ids = chat_ids[6]  # the longest prompt: several full blocks and a partial one
    unified = dec.add_request(ids, P)
    finish(dec, unified)
    dec.kv.pool.reset_cache()
    payload = prefill(pre, ids)
    assert payload.num_blocks == -(-len(ids) // 16) and payload.first_token == unified.output_token_ids[0]
    before = dec.stats().steps.prompt_tokens_computed
    req = dec.add_request(None, P, kv=payload)
    dec.step()  # imports: the blocks are in use before any compute
    assert dec.kv.pool.num_used >= payload.num_blocks
    finish(dec, req)
    assert req.output_token_ids == unified.output_token_ids
    assert dec.stats().steps.prompt_tokens_computed == before  # 0 prompt tokens computed for it
    assert dec.kv.pool.num_free == dec.kv.pool.num_blocks


def test_corrupted_block_changes_the_output(engines, chat_ids):
    pre, dec = engines
    ids = chat_ids[6]
    good = prefill(pre, ids)
    bad = prefill(pre, ids)
    bad.k[:, 1].normal_()  # scramble one block's keys in every layer
    bad.v[:, 1].normal_()
    outs = []
    for payload in (good, bad):
        dec.kv.pool.reset_cache()
        req = dec.add_request(None, P, kv=payload)
        finish(dec, req)
        outs.append(req.output_token_ids)
    assert outs[0] != outs[1]


def test_payload_for_other_tokens_is_refused(engines, chat_ids):
    pre, dec = engines
    payload = prefill(pre, chat_ids[6])
    payload.block_hashes[0] = "00" * 16
    cached = dict(dec.kv.pool.cached)
    with pytest.raises(UpstreamError, match="block hashes"):
        dec.add_request(None, P, kv=payload)
    assert not dec.has_unfinished() and dec.kv.pool.num_free == dec.kv.pool.num_blocks
    assert dec.kv.pool.cached == cached  # refused before any block was allocated or registered


def refused(dec, payload, needle: str) -> None:
    """The import is refused before any block is allocated or registered: pool and prefix map exactly as before."""
    free, cached = dec.kv.pool.num_free, dict(dec.kv.pool.cached)
    with pytest.raises(UpstreamError, match=needle):
        dec.add_request(None, P, kv=payload)
    assert not dec.has_unfinished() and dec.kv.pool.num_free == free and dec.kv.pool.cached == cached


def test_payload_of_the_wrong_shape_is_refused(engines, chat_ids):
    pre, dec = engines
    payload = prefill(pre, chat_ids[6])
    payload.k, payload.v = payload.k[..., :-1], payload.v[..., :-1]  # a model with another head size
    refused(dec, payload, "shape")


def test_payload_from_another_model_is_refused(engines, chat_ids):
    pre, dec = engines
    payload = prefill(pre, chat_ids[6])
    root = dec.kv.root
    dec.kv.root = b"another-model-fp"  # a decode pod of another model, as during a rollout
    try:
        refused(dec, payload, "block hashes")
    finally:
        dec.kv.root = root
    assert dec.fingerprint == pre.fingerprint == root and root  # same weights, same identity


def test_truncated_payload_is_the_peers_fault(engines, chat_ids):
    pre, _ = engines
    data = prefill(pre, chat_ids[6]).to_bytes()
    with pytest.raises(UpstreamError, match="malformed"):
        KVPayload.from_bytes(data[:-7])
