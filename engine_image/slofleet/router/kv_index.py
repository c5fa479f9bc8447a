"""Precise prefix routing (`--policy precise`): route on what each engine's prefix cache really holds.

Each replica's KV events (`slofleet serve --kv-events-endpoint`, vLLM's wire format, engine/server/kv_events.py)
are followed over ZMQ; the index maps block hash -> replicas holding it. A request is tokenized with the model's
own tokenizer and chat template, exactly as the engine does (engine.tokenize, api.chat_prompt), and hashed with the
engine's published chain (kv_events.ExternalChain: vLLM's sha256_cbor over full blocks, the model's fingerprint as
the first block's key), so a replica's score is the number of leading blocks of the prompt it holds.

A replica's entries are dropped when its events may no longer be trusted: AllBlocksCleared, a new epoch in the
topic (the engine restarted), a lost connection to its publisher (a restart shows here before any new event), or
a sequence gap that the replay socket cannot fill. The index is bounded (`max_blocks` entries over all replicas,
least recently stored dropped first) and its size is exported. Loading the tokenizer imports transformers and the
engine's loader (torch): only with this policy on.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from urllib.parse import urlsplit

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("slofleet.router.kv_index")
END = (-1).to_bytes(8, "big", signed=True)
ENTRY_BYTES = 420  # measured (tracemalloc, CPython 3.11): one (replica, hash) entry, 240 when 3 replicas share it
REPLAY_TIMEOUT_S = 1.0
PENDING_S = 30.0  # how long a new prefix's placement is remembered while its blocks are not yet in the events
MAX_PENDING = 4096


class PrefixIndex:
    """block hash -> replicas holding it, bounded by an LRU over (replica, hash) entries."""

    def __init__(self, max_blocks: int = 1_000_000):
        self.max_blocks = max_blocks
        self.lru: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.holders: dict[int, set[str]] = {}
        self.count: Counter[str] = Counter()  # blocks each replica holds
        self.block_size: int | None = None  # from the events: the chain is over blocks of this many tokens

    def __len__(self) -> int:
        return len(self.lru)

    @property
    def bytes(self) -> int:
        return len(self.lru) * ENTRY_BYTES

    def stored(self, url: str, hashes: list[int]) -> None:
        for h in hashes:
            if (url, h) not in self.lru:
                self.count[url] += 1
            self.lru[(url, h)] = None
            self.lru.move_to_end((url, h))
            self.holders.setdefault(h, set()).add(url)
        while len(self.lru) > self.max_blocks:
            self._drop(*self.lru.popitem(last=False)[0])

    def _drop(self, url: str, h: int) -> None:
        self.count[url] -= 1
        held = self.holders.get(h)
        if held is not None:
            held.discard(url)
            if not held:
                del self.holders[h]

    def removed(self, url: str, hashes: list[int]) -> None:
        for h in hashes:
            if (url, h) in self.lru:
                del self.lru[(url, h)]
                self._drop(url, h)

    def clear(self, url: str) -> None:
        gone = [k for k in self.lru if k[0] == url]
        for k in gone:
            del self.lru[k]
            self._drop(*k)
        if gone:
            log.info("prefix index: dropped %d blocks of %s", len(gone), url)

    def apply(self, url: str, events: list) -> None:
        for ev in events:
            kind = ev[0]
            if kind == "BlockStored":
                self.block_size = ev[4]
                self.stored(url, ev[1])
            elif kind == "BlockRemoved":
                self.removed(url, ev[1])
            elif kind == "AllBlocksCleared":
                self.clear(url)

    def match(self, chain: list[int], urls: list[str]) -> dict[str, int]:
        """Per replica, how many leading blocks of the chain it holds."""
        alive, out = set(urls), dict.fromkeys(urls, 0)
        for i, h in enumerate(chain):
            alive &= self.holders.get(h, set())
            if not alive:
                break
            for u in alive:
                out[u] = i + 1
        return out


class Tokenized:
    """The engine's token ids and published block hashes of a request (lazy: transformers, torch)."""

    def __init__(self, model: str):
        from slofleet.engine import loader
        from slofleet.engine.server.kv_events import ExternalChain, external_int

        path = loader.resolve(model)
        self.tokenizer = loader.load_tokenizer(path)
        self.hash, self.external_int = ExternalChain(loader.fingerprint(path)), external_int

    def token_ids(self, messages: list[dict] | None, prompt) -> list[int] | None:
        if messages is not None:
            msgs = [{"role": "system" if m.get("role") == "developer" else m.get("role"), "content": content(m)}
                    for m in messages]
            try:
                return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)
            except Exception:  # the engine refuses it too (400); nothing to route on
                return None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return prompt if isinstance(prompt, list) else None

    def chain(self, ids: list[int], block_size: int) -> list[int]:
        out, parent = [], None
        for i in range(len(ids) // block_size):
            parent = self.hash(parent, ids[i * block_size:(i + 1) * block_size])
            out.append(self.external_int(parent))
        return out


def content(m: dict) -> str:
    c = m.get("content")
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict))
    return c or ""


class Subscriptions:
    """One SUB (and a monitor on it) per replica, connected to the replica's host at the endpoint templates
    (`tcp://{host}:5557`): replicas are found as the router finds them, their publishers at a fixed port."""

    def __init__(self, index: PrefixIndex, endpoint: str, replay_endpoint: str = ""):
        self.index, self.endpoint, self.replay_endpoint = index, endpoint, replay_endpoint
        self.ctx = zmq.asyncio.Context()
        self.tasks: dict[str, asyncio.Task] = {}
        self.wanted: set[str] = set()

    def at(self, template: str, url: str) -> str:
        return template.format(host=urlsplit(url).hostname)

    def sync(self, urls: list[str]) -> None:
        """Follow exactly these replicas (called on every change of the replica set, and at start)."""
        self.wanted = set(urls)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # before the event loop: start() follows them
        for url in set(self.tasks) - self.wanted:
            self.tasks.pop(url).cancel()
            self.index.clear(url)
        for url in self.wanted - set(self.tasks):
            self.tasks[url] = asyncio.create_task(self.follow(url))

    async def start(self) -> None:
        self.sync(list(self.wanted))
        await asyncio.Event().wait()  # the router's lifespan cancels it

    async def follow(self, url: str) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.at(self.endpoint, url))
        watch = asyncio.create_task(self.watch(url, monitor))
        epoch, last = None, -1
        try:
            while True:
                topic, seq_b, batch = await sub.recv_multipart()
                ep, seq = topic.split(b"@", 2)[1], int.from_bytes(seq_b, "big")
                if ep != epoch:  # a new engine process (or our first batch from it): what we knew is stale
                    self.index.clear(url)
                    epoch, last = ep, -1
                if seq > last + 1:
                    for s, missed in await self.replay(url, last + 1, seq):
                        self.index.apply(url, missed)
                        last = s
                    if seq > last + 1:
                        log.warning("KV events of %s: batches %d..%d lost, its index entries dropped", url, last + 1,
                                    seq - 1)
                        self.index.clear(url)
                if seq > last:
                    self.index.apply(url, msgpack.unpackb(batch)[1])
                    last = seq
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV events of %s: subscription failed, its index entries dropped", url)
            self.index.clear(url)
        finally:
            watch.cancel()
            monitor.close(0)
            sub.close(0)

    async def watch(self, url: str, monitor) -> None:
        while True:
            parse_monitor_message(await monitor.recv_multipart())
            self.index.clear(url)  # events may have been published while we were away

    async def replay(self, url: str, start: int, before: int) -> list[tuple[int, list]]:
        """Batches start..before-1 from the replica's replay socket, consecutive from start (empty: none)."""
        if not self.replay_endpoint:
            return []
        sock, out = self.ctx.socket(zmq.DEALER), []
        try:
            sock.connect(self.at(self.replay_endpoint, url))
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while await sock.poll(REPLAY_TIMEOUT_S * 1000):
                _, seq_b, batch = await sock.recv_multipart()
                if seq_b == END:
                    break
                seq = int.from_bytes(seq_b, "big")
                if seq != start + len(out):
                    break  # the replay buffer no longer holds some of them
                if seq < before:
                    out.append((seq, msgpack.unpackb(batch)[1]))
        finally:
            sock.close(0)
        return out


class Precise:
    """The precise policy's half of the balancer: a request's chain, and the replica it starts soonest on."""

    def __init__(self, model: str, endpoint: str, replay_endpoint: str = "", max_blocks: int = 1_000_000):
        self.index = PrefixIndex(max_blocks)
        self.tokens = Tokenized(model)
        self.subscriptions = Subscriptions(self.index, endpoint, replay_endpoint)
        self.pending: OrderedDict[int, tuple[str, int, float]] = OrderedDict()  # first block -> (replica, blocks, when)
        self.queued: Counter[str] = Counter()  # blocks placed on each replica, pending
        self.work = 0.0  # blocks a routed request has had to prefill, a running mean (see note)

    def chain(self, messages: list[dict] | None, prompt) -> list[int] | None:
        """None before any replica published a block (nothing to match: the hash policy routes)."""
        bs = self.index.block_size
        ids = self.tokens.token_ids(messages, prompt) if bs else None
        return self.tokens.chain(ids, bs) if ids else None

    def pick(self, replicas: list, chain: list[int], bound: float):
        """The replica where the request's prompt starts soonest: fewest of its blocks left to prefill plus the
        work queued ahead (load x the blocks a routed request has had to prefill, on average), among replicas under
        twice the load bound (a holder may take more than its share before its prefix must spill, as a miss costs
        a whole prefill). A prefix nobody holds is placed by place(). None when every replica is over the bound."""
        fits = [r for r in replicas if r.load() < 2 * bound]
        if not fits:
            return None
        held = self.index.match(chain, [r.url for r in fits])
        if not any(held.values()):
            return self.place(fits, chain)
        best = min(fits, key=lambda r: (len(chain) - held[r.url] + r.load() * (self.work + 1), r.load()))
        self.note(len(chain) - held[best.url])
        return best

    def place(self, fits: list, chain: list[int]):
        """A new prefix goes where the caches hold least (events, plus what was placed in the last PENDING_S), so
        tenants spread by room rather than by hash, and a restarted replica fills first; its next requests follow
        it while its blocks are not in the events yet. Placements expire oldest first: O(1) a request."""
        now = time.monotonic()
        while self.pending and (len(self.pending) >= MAX_PENDING
                                or now - next(iter(self.pending.values()))[2] >= PENDING_S):
            url, blocks, _ = self.pending.popitem(last=False)[1]
            self.queued[url] -= blocks
        by_url = {r.url: r for r in fits}
        placed = self.pending.pop(chain[0], None)
        if placed is not None:
            self.queued[placed[0]] -= placed[1]
        best = by_url.get(placed[0]) if placed is not None else None
        if best is None:
            best = min(fits, key=lambda r: (self.index.count[r.url] + self.queued[r.url], r.load()))
        self.pending[chain[0]] = (best.url, len(chain), now if placed is None else placed[2])
        self.queued[best.url] += len(chain)
        self.note(len(chain))
        return best

    def note(self, blocks: int) -> None:
        """Weight 0.1 on the newest; it starts at 0, so before any is known a queued request costs 1 block."""
        self.work = 0.9 * self.work + 0.1 * blocks
