"""KV events without a model: vLLM's block hash (pinned byte for byte), what the block pool records, the tagged
arrays, and the PUB / replay sockets' protocol (server/kv_events.py)."""
from __future__ import annotations

import hashlib
import time
from collections import deque
from types import SimpleNamespace

import msgpack
import torch
import zmq

from slofleet.engine.kv_cache_manager import KVCacheManager
from slofleet.engine.request import Request
from slofleet.engine.sampling_params import SamplingParams
from slofleet.engine.server.kv_events import END, ExternalChain, KVEventPublisher, external_int, wire_events
from tests.support.server import free_port

FP = bytes(range(16))


def req(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(), max_tokens=4)


def test_external_hash_is_vllms_sha256_cbor_chain():
    chain = ExternalChain(FP, seed="")
    # NONE_HASH = sha256(cbor("")); a block hashes the canonical CBOR of [parent, [tokens], extra_keys].
    none = hashlib.sha256(b"\x60").digest()
    assert chain.none_hash == none
    first = chain(None, [1, 2])
    salt = b"\x81\x78\x20" + FP.hex().encode()  # the fingerprint, hex: the first block's one extra key
    assert first == hashlib.sha256(b"\x83\x58\x20" + none + b"\x82\x01\x02" + salt).digest()
    second = chain(first, [1000, 70000])  # uint16 and uint32 heads; no extra key after the first block
    assert second == hashlib.sha256(b"\x83\x58\x20" + first + b"\x82\x19\x03\xe8\x1a\x00\x01\x11\x70\xf6").digest()
    assert external_int(second) == int.from_bytes(second, "big") & (2**64 - 1)
    assert ExternalChain(bytes(16), seed="")(None, [1, 2]) != first  # another model, other names
    assert ExternalChain(FP, seed="42")(None, [1, 2]) != first


def manager(num_blocks: int = 4) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, 4, root=FP)
    kv.pool.events, kv.external = deque(), ExternalChain(FP, seed="")
    return kv


def test_pool_records_stored_removed_cleared():
    kv, chain = manager(), ExternalChain(FP, seed="")
    a = req("a", list(range(9)))  # two full blocks and one token
    assert kv.allocate(a, 9)
    h0 = chain(None, [0, 1, 2, 3])
    h1 = chain(h0, [4, 5, 6, 7])
    assert list(kv.pool.events) == [("stored", h0, None, [0, 1, 2, 3]), ("stored", h1, h0, [4, 5, 6, 7])]
    assert a.block_hashes == kv.chain(list(range(8)))  # the engine's own chain is unchanged
    kv.free(a)
    kv.pool.events.clear()
    b = req("b", list(range(100, 116)))  # four blocks: both of a's cached blocks are evicted, its tail first
    assert kv.allocate(b, 16)
    removed = [e for e in kv.pool.events if e[0] == "removed"]
    assert removed == [("removed", h1), ("removed", h0)]
    kv.pool.events.clear()
    kv.pool.reset_cache()
    assert list(kv.pool.events) == [("cleared",)]


def test_a_hit_prefix_is_the_parent_and_duplicates_are_not_stored():
    kv, chain = manager(8), ExternalChain(FP, seed="")
    a = req("a", list(range(5)))
    assert kv.allocate(a, 5)
    b = req("b", list(range(9)))  # shares a's first block: a hit, then one new block whose parent is it
    hits, _ = kv.computed_blocks(b)
    assert kv.allocate(b, 9 - len(hits) * 4, hits)
    h0 = chain(None, [0, 1, 2, 3])
    assert list(kv.pool.events) == [("stored", h0, None, [0, 1, 2, 3]), ("stored", chain(h0, [4, 5, 6, 7]), h0,
                                                                       [4, 5, 6, 7])]


def test_wire_format_coalesces_runs():
    h = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    events = [("cleared",), ("stored", h[0], None, [1, 2]), ("stored", h[1], h[0], [3, 4]),
              ("stored", h[2], h[3], [5, 6]), ("removed", h[0]), ("removed", h[1])]
    x = [external_int(v) for v in h]
    assert wire_events(events, 2, "GPU") == [
        ["AllBlocksCleared"], ["BlockStored", [x[0], x[1]], None, [1, 2, 3, 4], 2, None, "GPU"],
        ["BlockStored", [x[2]], x[3], [5, 6], 2, None, "GPU"], ["BlockRemoved", [x[0], x[1]], "GPU"]]


def recv(sock: zmq.Socket, timeout: float = 5.0) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), "nothing arrived"
    return sock.recv_multipart()


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, list]]:
    """What a subscriber that missed batches asks for (a DEALER speaking REQ's envelope)."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        empty, seq, batch = recv(sock)
        if seq == END:
            assert empty == b"" and batch == b""
            sock.close(0)
            return out
        out.append((int.from_bytes(seq, "big"), msgpack.unpackb(batch)))


def test_publisher_sends_batches_and_replays_them():
    kv = KVCacheManager(8, 4, root=FP)
    engine = SimpleNamespace(config=SimpleNamespace(block_size=4), runner=SimpleNamespace(device=torch.device("cpu")),
                             kv=kv, fingerprint=FP, model_name="m")
    pub_at, replay_at = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = KVEventPublisher(engine, pub_at, replay_at)
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(pub_at)
        # The start's AllBlocksCleared went out before this subscriber joined: replay has it.
        deadline = time.monotonic() + 5
        while not (got := replay(ctx, replay_at, 0)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got == [(0, [got[0][1][0], [["AllBlocksCleared"]]])]
        time.sleep(0.3)  # the subscription reaches the publisher
        a = req("a", list(range(8)))
        t0 = time.monotonic()
        assert kv.allocate(a, 8)  # what the engine thread does in a step
        topic, seq, batch = recv(sub)
        assert time.monotonic() - t0 < 1.0
        assert topic == f"kv@{publisher.epoch}@m".encode() and int.from_bytes(seq, "big") == 1
        ts, events = msgpack.unpackb(batch)
        assert abs(ts - time.time()) < 5 and [e[0] for e in events] == ["BlockStored"]
        assert events[0][1] == [external_int(h) for h in a.ext_hashes] and events[0][3] == list(range(8))
        assert [s for s, _ in replay(ctx, replay_at, 1)] == [1]
        assert replay(ctx, replay_at, 2) == []
    finally:
        ctx.destroy(linger=0)
        publisher.close()
