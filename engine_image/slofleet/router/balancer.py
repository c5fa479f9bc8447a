"""Replica choice: prefix affinity by consistent hashing with bounded load, least load otherwise.

Affinity key: the router has no tokenizer, so it hashes the prompt's leading *characters* — the flattened
prompt's first `affinity_chars` characters (for chat, every message's role and text in order). Two requests
sharing that many leading characters share their leading tokens, hence the engine's leading KV blocks (the
engine's own hash chain is over token blocks, block_pool.hash_block). Hashing a fixed-length head rather than the
whole prompt is what makes requests with a common system prompt or document but different questions land
together. Prompts shorter than that head carry little KV worth reusing and go to the least-loaded replica.

Bounded load (Mirrokni, Thorup, Zadimoghaddam 2018): each replica may hold at most ceil(c * (total + 1) / n)
requests; the key's ring position is walked clockwise to the first replica under that bound, so a hot prefix
spills to its ring neighbours instead of queueing on one replica, and a removed replica only moves its own keys.
A replica whose KV cache is nearly full is skipped the same way.

`precise` (kv_index.py) scores replicas by what their KV events say they hold: the blocks of the request each
would still have to prefill plus the work queued on it, under twice the load bound; a prefix none holds goes to
the replica whose cache holds least, and its next requests follow it until its blocks show in the events. Before
any event (no block size to hash with) it routes by this hashing."""
from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .replicas import Replica

if TYPE_CHECKING:
    from .kv_index import Precise


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(text: str, affinity_chars: int) -> int | None:
    if len(text) < affinity_chars:
        return None
    return _h(text[:affinity_chars].encode())


class Ring:
    def __init__(self, urls: list[str], vnodes: int = 64):
        points = sorted((_h(f"{u}#{i}".encode()), u) for u in urls for i in range(vnodes))
        self.hashes = [h for h, _ in points]
        self.urls = [u for _, u in points]

    def walk(self, key: int):
        """Distinct replica URLs in ring order, starting at the key's position."""
        if not self.urls:
            return
        start, seen = bisect.bisect(self.hashes, key), set()
        for i in range(len(self.urls)):
            u = self.urls[(start + i) % len(self.urls)]
            if u not in seen:
                seen.add(u)
                yield u


@dataclass(frozen=True)
class Prefix:
    """A request's affinity under the precise policy: its block hash chain, and its ring key to fall back on."""
    ring: int | None
    chain: list[int]


class Balancer:
    def __init__(self, policy: str = "prefix", load_factor: float = 1.25, kv_full: float = 0.95,
                 precise: Precise | None = None):
        if policy not in ("prefix", "least-load", "round-robin", "precise") or (policy == "precise") != bool(precise):
            raise ValueError(f"unknown routing policy {policy!r}, or precise without its index")
        self.policy, self.load_factor, self.kv_full, self.precise = policy, load_factor, kv_full, precise
        self.ring = Ring([])
        self.rr = 0  # round-robin's next turn

    def set_urls(self, urls: list[str]) -> None:
        self.ring = Ring(urls)
        if self.precise is not None:
            self.precise.subscriptions.sync(urls)

    def key(self, messages: list[dict] | None, prompt, text: str, affinity_chars: int) -> int | Prefix | None:
        ring = prefix_key(text, affinity_chars)
        chain = self.precise.chain(messages, prompt) if self.precise is not None else None
        return Prefix(ring, chain) if chain else ring

    def how(self, key: int | Prefix | None) -> str:
        """How a request with this key is routed, as metrics and traces name it: under prefix, a prompt without a
        full block to match goes by load."""
        return "least-load" if key is None and self.policy == "prefix" else self.policy

    def hows(self) -> tuple[str, ...]:
        """Every value how() can give under this policy."""
        return (self.how(0), self.how(None)) if self.policy == "prefix" else (self.policy,)

    def choose(self, ready: list[Replica], key: int | None, exclude: set[str]) -> Replica | None:
        cands = [r for r in ready if r.url not in exclude]
        if not cands:
            return None
        if self.policy == "round-robin":
            self.rr += 1
            return cands[(self.rr - 1) % len(cands)]
        roomy = [r for r in cands if r.kv_usage < self.kv_full] or cands
        if self.policy == "least-load" or key is None:
            return min(roomy, key=lambda r: (r.load(), r.kv_usage))
        bound = math.ceil(self.load_factor * (sum(r.load() for r in cands) + 1) / len(cands))
        if isinstance(key, Prefix):  # the soonest start by the index; every replica over the bound: hashing
            r = self.precise.pick(roomy, key.chain, bound)
            if r is not None or key.ring is None:
                return r or min(roomy, key=lambda r: (r.load(), r.kv_usage))
            key = key.ring
        return self.on_ring(roomy, cands, key)

    def preview(self, ready: list[Replica], key: int | Prefix | None) -> Replica | None:
        """The replica a request with this key would go to now, for admission to predict on, with no side effect:
        round-robin's turn is not taken, and the precise policy's placement is not recorded (its ring key stands
        in for its index)."""
        if not ready:
            return None
        if self.policy == "round-robin":
            return ready[self.rr % len(ready)]
        if isinstance(key, Prefix):
            key = key.ring
        roomy = [r for r in ready if r.kv_usage < self.kv_full] or ready
        if key is None or self.policy == "least-load":
            return min(roomy, key=lambda r: (r.load(), r.kv_usage))
        return self.on_ring(roomy, ready, key)

    def on_ring(self, roomy: list[Replica], cands: list[Replica], key: int) -> Replica:
        """The first replica under the load bound clockwise from the key, else the least loaded."""
        bound = math.ceil(self.load_factor * (sum(r.load() for r in cands) + 1) / len(cands))
        by_url = {r.url: r for r in roomy}
        for url in self.ring.walk(key):
            r = by_url.get(url)
            if r is not None and r.load() < bound:
                return r
        return min(roomy, key=lambda r: r.load())
