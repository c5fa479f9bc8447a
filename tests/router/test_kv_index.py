"""The precise policy's prefix index (router/kv_index.py) without engines: the index itself, the choice it makes in
the balancer, and its subscriptions against a stand-in publisher speaking the engines' wire format (PUB + replay
ROUTER): restarts, gaps filled by replay, gaps that cannot be, and lost connections."""
from __future__ import annotations

import asyncio
import threading

import msgpack
import pytest
import zmq

from slofleet.router import kv_index
from slofleet.router.balancer import Balancer, Prefix
from slofleet.router.kv_index import END, PrefixIndex, Subscriptions
from slofleet.router.replicas import Replica
from tests.support.server import free_port

A, B, C = "http://127.0.0.1:1", "http://127.0.0.2:1", "http://127.0.0.3:1"


def test_index_match_remove_clear_and_bound():
    ix = PrefixIndex(max_blocks=5)
    ix.apply(A, [["BlockStored", [1, 2, 3], None, list(range(48)), 16, None, "CPU"]])
    ix.apply(B, [["BlockStored", [1], None, list(range(16)), 16, None, "CPU"]])
    assert ix.block_size == 16 and len(ix) == 4 and ix.bytes == 4 * kv_index.ENTRY_BYTES
    assert ix.match([1, 2, 3, 4], [A, B, C]) == {A: 3, B: 1, C: 0}
    assert ix.match([9, 1], [A, B]) == {A: 0, B: 0}  # a prefix, not any block
    ix.apply(A, [["BlockRemoved", [2], "CPU"]])
    assert ix.match([1, 2, 3], [A, B]) == {A: 1, B: 1}
    ix.stored(C, [7, 8, 9])  # over the bound: the least recently stored go first
    assert len(ix) == 5 and ix.match([1], [A, B]) == {A: 0, B: 1}
    ix.apply(B, [["AllBlocksCleared"]])
    assert ix.match([1], [B]) == {B: 0} and 1 not in ix.holders


class StubTokens:
    def token_ids(self, messages, prompt):
        return prompt

    def chain(self, ids, bs):
        return [sum(ids[:(i + 1) * bs]) for i in range(len(ids) // bs)]


@pytest.fixture
def precise(monkeypatch):
    monkeypatch.setattr(kv_index, "Tokenized", lambda model: StubTokens())
    return kv_index.Precise("stub", "tcp://{host}:1")


def test_longest_prefix_then_load_then_room(precise, monkeypatch):
    bal = Balancer("precise", precise=precise)
    bal.set_urls([A, B, C])
    rs = [Replica(A, ready=True), Replica(B, ready=True), Replica(C, ready=True)]
    prompt = list(range(64))
    assert isinstance(bal.key(None, prompt, "x" * 300, 256), int)  # no block published yet: hashing
    chain = StubTokens().chain(prompt, 16)
    precise.index.apply(A, [["BlockStored", chain[:2], None, prompt[:32], 16, None, "CPU"]])
    precise.index.stored(B, chain[:3])
    key = bal.key(None, prompt, "x" * 300, 256)
    assert isinstance(key, Prefix) and key.chain == chain
    assert bal.choose(rs, key, set()).url == B
    precise.index.stored(C, chain[:3])
    rs[1].inflight = 1
    assert bal.choose(rs, key, set()).url == C  # as long a prefix, less load
    rs[1].inflight = rs[2].inflight = 9  # their queues cost more than the block A lacks
    assert bal.choose(rs, key, set()).url == A
    rs[1].inflight = rs[2].inflight = 0
    # a prefix nobody holds: the replica whose cache holds least (A: 2 blocks), and its next request follows it
    # there, busy or not, until its blocks show in the events
    new = Prefix(bal.key(None, None, "y" * 300, 256), [101, 102, 103, 104, 105])
    assert bal.choose(rs, new, set()).url == A
    rs[0].inflight = 1
    assert bal.choose(rs, new, set()).url == A
    # A's 2 blocks and the 5 placed there outweigh B's and C's 3: the next new prefix goes to B
    assert bal.choose(rs, Prefix(None, [201]), set()).url == B
    precise.index.stored(A, [101])  # its first block is in A's events now: the index leads, the placement goes
    assert bal.choose(rs, new, set()).url == B  # A saves 1 block of 5, its request in flight costs about 2
    rs[0].inflight = 0
    assert bal.choose(rs, new, set()).url == A
    rs[0].inflight = 1
    # A 3 blocks and 5 placed (counted twice until the placement expires), B 3 and 1 placed, C 3
    assert bal.choose(rs, Prefix(None, [301]), set()).url == C
    monkeypatch.setattr(kv_index, "PENDING_S", 0.0)  # every placement expires at the next one
    assert bal.choose(rs, Prefix(None, [401]), set()).url == B  # 3 blocks each, A busy: the first of B and C
    assert list(precise.pending) == [401] and +precise.queued == {B: 1}


def test_a_holder_keeps_its_prefix_until_its_queue_costs_more_than_a_miss(precise):
    bal = Balancer("precise", precise=precise)
    bal.set_urls([A, B])
    rs = [Replica(A, ready=True), Replica(B, ready=True)]
    chain = [1, 2, 3, 4]
    precise.index.block_size = 16
    precise.index.stored(A, chain)
    precise.work = 3.0  # routed requests have had 3 blocks to prefill on average
    assert bal.choose(rs, Prefix(None, chain), set()).url == A
    assert precise.work == 0.9 * 3.0  # that one had none to prefill
    precise.work = 3.0
    rs[0].inflight = 1  # 1 x (3 + 1) = 4: as much as B's whole miss, and more load
    assert bal.choose(rs, Prefix(None, chain), set()).url == B
    rs[0].inflight = 0
    precise.index.stored(B, chain[:1])
    rs[1].inflight = 0
    assert bal.choose(rs, Prefix(None, chain), set()).url == A
    rs[0].inflight, rs[1].inflight = 5, 0  # over twice the load bound of ceil(1.25 * 6 / 2) = 4: not a candidate
    assert bal.choose(rs, Prefix(None, chain), set()).url == B


class Publisher:
    """A stand-in engine publisher: PUB on one port, the replay ROUTER on the next, batches buffered for replay."""

    def __init__(self):
        self.port = free_port()
        self.ctx = zmq.Context()
        self.pub, self.replay = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve_replay, daemon=True)
        self.thread.start()

    def send(self, epoch: int, seq: int, events: list, publish: bool = True) -> None:
        batch = msgpack.packb([0.0, events])
        self.buffer.append((seq, batch))
        if publish:
            self.pub.send_multipart([f"kv@{epoch}@m".encode(), seq.to_bytes(8, "big"), batch])

    def serve_replay(self) -> None:
        while not self.stop.is_set():
            if self.replay.poll(50):
                ident, empty, start = self.replay.recv_multipart()
                for seq, batch in self.buffer:
                    if seq >= int.from_bytes(start, "big"):
                        self.replay.send_multipart([ident, b"", seq.to_bytes(8, "big"), batch])
                self.replay.send_multipart([ident, b"", END, b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.ctx.destroy(linger=0)


def stored(*hashes: int) -> list:
    return [["BlockStored", list(hashes), None, [0] * 16 * len(hashes), 16, None, "CPU"]]


async def until(cond, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_subscription_restart_gap_replay_and_disconnect():
    pub = Publisher()
    ix = PrefixIndex()
    subs = Subscriptions(ix, f"tcp://{{host}}:{pub.port}", f"tcp://{{host}}:{pub.replay_port}")
    url = "http://127.0.0.1:8000"

    async def scenario():
        subs.sync([url])
        await asyncio.sleep(0.3)  # the SUB connects (a PUB drops what it sends before)
        pub.send(1, 0, [["AllBlocksCleared"]] + stored(1, 2))
        await until(lambda: ix.match([1, 2], [url])[url] == 2)
        pub.send(1, 1, stored(3), publish=False)  # lost on the way: replayed when seq 2 shows the gap
        pub.send(1, 2, stored(4))
        await until(lambda: ix.match([1, 2, 3, 4], [url])[url] == 4)
        pub.buffer.clear()  # a gap the replay buffer no longer holds: what we knew is dropped
        pub.send(1, 5, stored(9))
        await until(lambda: ix.match([1], [url])[url] == 0)
        assert ix.match([9], [url])[url] == 1  # what came after the gap is kept
        pub.send(2, 0, stored(5))  # a new epoch: the engine restarted
        await until(lambda: ix.match([5], [url])[url] == 1)
        assert ix.match([9], [url])[url] == 0
        pub.close()  # the publisher's connection drops: entries go before any new event
        await until(lambda: len(ix) == 0)
        subs.sync([])
        assert not subs.tasks

    try:
        asyncio.run(scenario())
    finally:
        pub.close()
        subs.ctx.destroy(linger=0)
