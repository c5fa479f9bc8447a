"""Fixed pool of KV blocks: ref counts, an LRU free list, the prefix-cache map hash -> block, and (when a subscriber
asks for them) the cache's changes as events."""
from __future__ import annotations

import array
import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

from .errors import PoolExhausted


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    ext_hash: bytes | None = None  # its name in KV events, while cached


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Chain hash over a full block: stable across processes so a KV hand-off can name blocks."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array.array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = least recently freed); O(1) removal by id.
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.enable_caching = enable_caching
        self.evictions = 0  # cached blocks reused for new content
        # KV events, oldest first: ("stored", ext_hash, ext_parent, token_ids), ("removed", ext_hash), ("cleared",).
        # None until a publisher (server/kv_events.py) sets a deque, which it drains from its own thread.
        self.events: deque[tuple] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return sum(1 for b in self.blocks if b.ref_count > 0)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[Block]:
        if n > len(self.free):
            raise PoolExhausted(f"asked for {n} KV blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)
            if block.block_hash is not None:  # evict the least recently used cached block
                del self.cached[block.block_hash]
                if self.events is not None and block.ext_hash is not None:
                    self.events.append(("removed", block.ext_hash))
                block.block_hash = block.ext_hash = None
                self.evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cache hits; a free cached block leaves the free list."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: list[Block], reuse_first: bool = False) -> None:
        """reuse_first: the blocks hold nothing worth caching (a draft's rejected slots), so they go to the front of
        the free list and are taken again before any cached block is evicted."""
        # Reverse order so a request's tail blocks are evicted before its shared head.
        for block in reversed(blocks):
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} released twice"
            if block.ref_count == 0:
                self.free[block.block_id] = block
                if reuse_first:
                    self.free.move_to_end(block.block_id, last=False)

    def register(self, block: Block, block_hash: bytes, event: tuple | None = None) -> None:
        """event: (ext_hash, ext_parent, token_ids) of the block, recorded when it enters the cache."""
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            if self.events is not None and event is not None:
                block.ext_hash = event[0]
                self.events.append(("stored", *event))

    def reset_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = block.ext_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(("cleared",))
