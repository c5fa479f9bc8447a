"""KV events: the prefix cache's changes in vLLM's wire format, published over ZMQ for KV-aware routers (ours, llm-d's).

PUB socket: multipart [topic, seq (8-byte big-endian, from 0 per process), msgpack EventBatch], EventBatch =
[ts, events], each event a tagged array: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"] (first, at every start, and on a
cache reset). The topic is kv@EPOCH@MODEL: EPOCH (nanoseconds at start) changes with every process, so a subscriber
tells a restart (new epoch, seq from 0) from a gap (same epoch, seq skipped), which it fills from the replay socket:
a ROUTER; a request is an 8-byte big-endian start sequence, the reply one [seq, batch] per buffered batch from
there, then [-1, b""].

Block hashes are vLLM's external form: its sha256_cbor chain (sha256 of the canonical CBOR of (parent, token_ids,
extra_keys), the first block's parent NONE_HASH = sha256_cbor(seed)), published as the low 64 bits. The model's
fingerprint (LLMEngine.fingerprint, hex) is the first block's extra key, where vLLM puts a request's cache_salt, so
that two models' blocks never share a name. The seed is $PYTHONHASHSEED as in vLLM, "" when unset (llm-d's indexer
default) rather than vLLM's random one, so replicas agree.

The engine's own chain (blake2b, what the KV hand-off checks) stays: it must not change with a deploy-time seed,
and the engine core imports no CBOR. This one is computed beside it (KVCacheManager.external) only while events
are on: about 1 us more per block on CPU.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque

import cbor2
import msgpack
import zmq

from slofleet.api.contract import KV_EVENTS_TOPIC, KV_HASH_SEED_ENV

from ..engine import LLMEngine

log = logging.getLogger("slofleet.engine.kv_events")
END = (-1).to_bytes(8, "big", signed=True)
REPLAY_BATCHES = 10_000  # as vLLM's buffer_steps
POLL_S = 0.02  # how long events wait in the pool at most before they are sent


def sha256_cbor(obj) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def external_int(block_hash: bytes) -> int:
    """The 64-bit int vLLM publishes for a block hash (its low 64 bits, big-endian)."""
    return int.from_bytes(block_hash[-8:], "big")


class ExternalChain:
    """hash(parent, token_ids) of vLLM's chain, with the model's fingerprint as the first block's extra key."""

    def __init__(self, fingerprint: bytes, seed: str | None = None):
        self.none_hash = sha256_cbor(os.environ.get(KV_HASH_SEED_ENV, "") if seed is None else seed)
        self.first_keys = (fingerprint.hex(),)

    def __call__(self, parent: bytes | None, token_ids: list[int]) -> bytes:
        first = parent is None
        return sha256_cbor((self.none_hash if first else parent, tuple(token_ids), self.first_keys if first else None))


def wire_events(events: list[tuple], block_size: int, medium: str) -> list[list]:
    """The pool's events as vLLM's tagged arrays; a run of stored blocks, each the parent of the next, is one
    BlockStored (as vLLM sends a request's new blocks), and consecutive removals one BlockRemoved."""
    out: list[list] = []
    last_stored = None
    for kind, *rest in events:
        prev = out[-1] if out else None
        if kind == "stored":
            block_hash, parent, token_ids = rest
            if prev and prev[0] == "BlockStored" and parent is not None and parent == last_stored:
                prev[1].append(external_int(block_hash))
                prev[3].extend(token_ids)
            else:
                out.append(["BlockStored", [external_int(block_hash)], None if parent is None else
                            external_int(parent), list(token_ids), block_size, None, medium])
            last_stored = block_hash
        elif kind == "removed":
            if prev and prev[0] == "BlockRemoved":
                prev[1].append(external_int(rest[0]))
            else:
                out.append(["BlockRemoved", [external_int(rest[0])], medium])
        else:
            out.append(["AllBlocksCleared"])
    return out


class KVEventPublisher:
    """Binds the sockets at once (a taken port fails the start), then a thread sends what the engine's block pool
    records: the engine thread only appends to a deque."""

    def __init__(self, engine: LLMEngine, endpoint: str, replay_endpoint: str = ""):
        self.epoch = time.time_ns()
        self.topic = f"{KV_EVENTS_TOPIC}@{self.epoch}@{engine.model_name}".encode()
        self.block_size = engine.config.block_size
        self.medium = "GPU" if engine.runner.device.type == "cuda" else "CPU"
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        self.replay = None
        try:
            self.pub.bind(endpoint)
            if replay_endpoint:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self.ctx.destroy(linger=0)
            raise OSError(f"cannot bind the KV events sockets ({endpoint}, replay {replay_endpoint or 'off'}): "
                          f"{e}") from None
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        pool, kv = engine.kv.pool, engine.kv
        self.events = pool.events = deque([("cleared",)])  # a fresh cache: subscribers drop what they knew
        kv.external = ExternalChain(engine.fingerprint)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()
        log.info("KV events on %s (replay %s), topic %s", endpoint, replay_endpoint or "off", self.topic.decode())

    def _send(self) -> None:
        events = []
        while self.events:
            events.append(self.events.popleft())
        if not events:
            return
        batch = msgpack.packb([time.time(), wire_events(events, self.block_size, self.medium)])
        self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), batch])
        self.buffer.append((self.seq, batch))
        self.seq += 1

    def _serve_replay(self) -> None:
        frames = self.replay.recv_multipart()
        # A REQ client's envelope has an empty delimiter after its identity; a DEALER's may not.
        head, body = (frames[:2], frames[2:]) if len(frames) > 2 and frames[1] == b"" else (frames[:1], frames[1:])
        if len(body) != 1 or len(body[0]) != 8:
            log.warning("ignored a malformed replay request (%d frames)", len(frames))
            return
        start = int.from_bytes(body[0], "big")
        for seq, batch in list(self.buffer):
            if seq >= start:
                self.replay.send_multipart([*head, seq.to_bytes(8, "big"), batch])
        self.replay.send_multipart([*head, END, b""])

    def _run(self) -> None:
        poller = zmq.Poller()
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        while not self.stopping.is_set():
            try:
                self._send()
                if self.replay is None:
                    self.stopping.wait(POLL_S)
                elif poller.poll(POLL_S * 1000):
                    self._serve_replay()
            except Exception:  # a publishing fault must not take the engine down; subscribers see the gap
                log.exception("KV event publishing failed")
                self.stopping.wait(POLL_S)
        self._send()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.ctx.destroy(linger=1000)  # a second for the last batch to leave
