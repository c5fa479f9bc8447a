"""KV events from a real `slofleet serve`, read as an outside subscriber would (pyzmq + msgpack, nothing of ours):
BlockStored for a prompt's full blocks under vLLM's hashes, BlockRemoved when a small pool evicts them,
AllBlocksCleared at every start (a new epoch), batches in order without gaps, and the replay socket."""
from __future__ import annotations

import hashlib
import queue
import threading
import time

import cbor2
import httpx
import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from slofleet.engine import loader
from tests.support.server import Server, free_port

pytestmark = pytest.mark.slow

MODEL, BS, SEED = "SmolLM2-135M-Instruct", 16, "7"
END = b"\xff" * 8


def vllm_hashes(tokens: list[int], fingerprint: bytes) -> list[int]:
    """vLLM's external block hashes, from its definition: sha256 over canonical CBOR of (parent, tokens, extra
    keys), NONE_HASH = sha256_cbor(PYTHONHASHSEED) as the first parent, the fingerprint as the first block's key."""
    def sha256_cbor(obj) -> bytes:
        return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

    parent, out = None, []
    for i in range(len(tokens) // BS):
        extra = None if parent else (fingerprint.hex(),)
        parent = sha256_cbor((parent or sha256_cbor(SEED), tuple(tokens[i * BS:(i + 1) * BS]), extra))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


class Subscriber:
    """SUB on the events, read by a thread of its own as a real subscriber does (a SUB that nobody calls does not
    renew its subscription after the engine restarts); a DEALER (REQ's envelope) on replay fills any gap."""

    def __init__(self, pub: str, replay: str):
        self.ctx = zmq.Context()
        self.replay_at = replay
        self.epochs: dict[str, dict[int, list]] = {}  # epoch -> seq -> events, in arrival order of epochs
        self.inbox: queue.Queue[list[bytes]] = queue.Queue()
        self.closed = threading.Event()
        self.joined = 0  # handshakes with an engine's publisher: one an engine start
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)  # before the engine binds: ZMQ connects once it does
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        threading.Thread(target=self._receive, args=(sub, monitor), daemon=True).start()

    def _receive(self, sub: zmq.Socket, monitor: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while not self.closed.is_set():
            ready = dict(poller.poll(50))
            if monitor in ready:
                recv_monitor_message(monitor)
                self.joined += 1
            if sub in ready:
                self.inbox.put(sub.recv_multipart())
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)

    def wait_joined(self, n: int, timeout: float = 10) -> None:
        """Until the n-th engine's publisher has the subscription. The engine binds its publisher only once its model
        is loaded, and a request sent right after it is ready can finish before ZMQ's reconnect (every 100 ms) gets
        there: its events are then lost to this subscriber, as to any that joins late, and nothing after them shows
        the gap to fill from replay (a step's events came 0.2 s after the bind in a CI run, and never arrived)."""
        deadline = time.monotonic() + timeout
        while self.joined < n:
            assert time.monotonic() < deadline, f"joined {self.joined} of {n} publishers"
            time.sleep(0.01)

    def close(self) -> None:
        self.closed.set()
        time.sleep(0.2)
        self.ctx.destroy(linger=0)

    def replay(self, start: int) -> list[tuple[int, list]]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_at)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(5000), "replay did not answer"
            _, seq, batch = sock.recv_multipart()
            if seq == END:
                sock.close(0)
                return out
            out.append((int.from_bytes(seq, "big"), msgpack.unpackb(batch)[1]))

    def pump(self, done, timeout: float = 30) -> float:
        """Receive until done(self) holds; the time it did."""
        deadline = time.monotonic() + timeout
        while not done(self):
            assert time.monotonic() < deadline, f"timed out; got {self.epochs}"
            try:
                topic, seq_bytes, batch = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            kv, epoch, model = topic.decode().split("@")
            assert (kv, model) == ("kv", MODEL)
            seen, seq = self.epochs.setdefault(epoch, {}), int.from_bytes(seq_bytes, "big")
            if seq > len(seen):  # a gap: what this subscriber missed (here: the start's batch, sent before it joined)
                for s, events in self.replay(len(seen)):
                    seen.setdefault(s, events)
            ts, events = msgpack.unpackb(batch)
            assert abs(ts - time.time()) < 60
            seen[seq] = events
        return time.monotonic()

    def events(self, epoch: str) -> list[list]:
        seen = self.epochs[epoch]
        assert sorted(seen) == list(range(len(seen))), f"gaps in {sorted(seen)}"
        return [e for s in sorted(seen) for e in seen[s]]


def kinds(sub: Subscriber, epoch_index: int = 0) -> list[str]:
    epochs = list(sub.epochs)
    return [e[0] for e in sub.events(epochs[epoch_index])] if len(epochs) > epoch_index else []


def complete(srv: Server, ids: list[int]) -> float:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return time.monotonic()


def test_events_of_a_real_engine_across_eviction_and_restart(tmp_path):
    fingerprint = loader.fingerprint(loader.resolve("default"))
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    # 8 blocks of 16 tokens: a second prompt of 120 tokens takes them all, evicting the first prompt's cache.
    flags = ("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay, "--num-blocks", "8",
             "--block-size", str(BS), "--max-model-len", "128", "--num-threads", "1")
    sub = Subscriber(pub, replay)
    a, b = list(range(1000, 1040)), list(range(2000, 2120))  # 2 full blocks (+8 tokens); 7 full blocks (+8)
    srv = Server(*flags, log=tmp_path / "first.log", env={"PYTHONHASHSEED": SEED})
    try:
        srv.wait_ready()
        sub.wait_joined(1)
        # What an endpoint picker reads of the KV cache, as vLLM exports it.
        assert srv.metrics()[f"vllm:cache_config_info{{block_size={BS},num_gpu_blocks=8}}"] == 1
        sent = complete(srv, a)
        got = sub.pump(lambda s: kinds(s) == ["AllBlocksCleared", "BlockStored"])
        assert got - sent < 1.0, "a step's events take at most a second"
        complete(srv, b)
        sub.pump(lambda s: kinds(s) == ["AllBlocksCleared", "BlockStored", "BlockRemoved", "BlockStored"])
        [first] = list(sub.epochs)
        ha, hb = vllm_hashes(a, fingerprint), vllm_hashes(b, fingerprint)
        assert sub.events(first) == [
            ["AllBlocksCleared"],
            ["BlockStored", ha, None, a[:32], BS, None, "CPU"],
            ["BlockRemoved", ha[::-1], "CPU"],  # LRU: a request's tail goes before its shared head
            ["BlockStored", hb, None, b[:112], BS, None, "CPU"]]
        # A subscriber that missed everything gets every batch back, with its sequence number.
        assert dict(sub.replay(0)) == sub.epochs[first]
        assert sub.replay(len(sub.epochs[first])) == []
    finally:
        srv.stop()
    srv = Server(*flags, log=tmp_path / "second.log", env={"PYTHONHASHSEED": SEED})
    try:
        srv.wait_ready()
        sub.wait_joined(2)
        complete(srv, a)
        sub.pump(lambda s: len(s.epochs) == 2 and kinds(s, 1) == ["AllBlocksCleared", "BlockStored"])
        second = list(sub.epochs)[1]
        assert int(second) > int(first)  # a restart, not a gap: a new epoch, numbered from 0, its cache cold
        assert sub.events(second) == [["AllBlocksCleared"], ["BlockStored", ha, None, a[:32], BS, None, "CPU"]]
    finally:
        srv.stop()
        sub.close()
