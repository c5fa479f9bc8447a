"""Per-request block tables over the block pool, with prefix-cache lookup and registration."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .block_pool import Block, BlockPool, hash_block
from .request import Request


@dataclass(slots=True)
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, root: bytes = b""):
        self.block_size = block_size
        self.root = root or None  # the model's fingerprint: the parent of every chain's first block
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[str, list[Block]] = {}
        self.stats = PrefixStats()
        # A second chain, for KV events (vLLM's, server/kv_events.py), set by their publisher: (parent or None for a
        # chain's first block, token_ids) -> hash. Each request's is kept beside its own, so that a block's event can
        # name its parent even after the parent left the cache.
        self.external: Callable[[bytes | None, list[int]], bytes] | None = None

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def chain(self, token_ids: list[int], parent: bytes | None = None, hasher: Callable | None = None) -> list[bytes]:
        """The hash chain over every full block of token_ids, continuing from parent (default: the root)."""
        out, bs = [], self.block_size
        hasher = hasher or (lambda p, tokens: hash_block(p or self.root, tokens))
        for i in range(len(token_ids) // bs):
            parent = hasher(parent, token_ids[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def _extend(self, hashes: list[bytes], req: Request, num_tokens: int, hasher: Callable | None = None) -> None:
        done, bs = len(hashes), self.block_size
        if num_tokens // bs > done:
            tokens = req.token_ids()[done * bs:num_tokens // bs * bs]
            hashes += self.chain(tokens, hashes[-1] if done else None, hasher)

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend the request's hash chain(s) over every full block of its first num_tokens tokens."""
        self._extend(req.block_hashes, req, num_tokens)
        if self.external is not None:
            self._extend(req.ext_hashes, req, num_tokens, self.external)

    def computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of full blocks. The last token is always left to compute,
        because its logits are needed to sample the next token."""
        if not self.pool.enable_caching:
            return [], 0
        limit = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, limit * self.block_size)
        hits: list[Block] = []
        for h in req.block_hashes[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate(self, req: Request, num_new_tokens: int, hits: list[Block] = (), lookahead: int = 0) -> bool:
        """Reserve blocks so num_computed + cached + num_new tokens fit, and lookahead slots past them (a draft's,
        which hold no real token and are never registered); False when the pool is short."""
        table = self.tables.setdefault(req.request_id, [])
        first_allocation = not table
        num_total = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        need = self.blocks_needed(num_total + lookahead) - len(table) - len(hits)
        evictable_hits = sum(1 for b in hits if b.ref_count == 0)
        if need > self.pool.num_free - evictable_hits:
            if not table:
                del self.tables[req.request_id]
            return False
        if first_allocation and self.pool.enable_caching:
            self.stats.queries += req.num_tokens
            self.stats.hits += len(hits) * self.block_size
        self.pool.touch(list(hits))
        table.extend(hits)
        if need > 0:
            table.extend(self.pool.allocate(need))
        # Blocks this step fills are registered now: their tokens are known and computed in this step.
        self._register(req, table, req.num_computed_tokens, num_total)
        return True

    def _register(self, req: Request, table: list[Block], start: int, end: int) -> None:
        """Put the full blocks among tokens [start, end) in the prefix cache."""
        self._update_hashes(req, end)
        # Hashes may run ahead of the table (computed for the whole prompt at lookup); register only
        # the blocks asked for.
        bs, ext, ids = self.block_size, req.ext_hashes, req.token_ids() if self.external else None
        for i in range(start // bs, end // bs):
            event = (ext[i], ext[i - 1] if i else None, ids[i * bs:(i + 1) * bs]) if ids else None
            self.pool.register(table[i], req.block_hashes[i], event)

    def rollback(self, req: Request, start: int) -> None:
        """After a verified draft (num_computed_tokens now counts the accepted ones): release the blocks past the
        request's tokens, which held rejected drafts' KV only, and register the full blocks the accepted drafts
        completed from token `start` on. A rejected token's slot left in the last block is overwritten by the
        next step before anything reads it."""
        table = self.tables[req.request_id]
        keep = self.blocks_needed(req.num_tokens)
        self.pool.release(table[keep:], reuse_first=True)
        del table[keep:]
        self._register(req, table, start, req.num_computed_tokens)

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Give child the parent's KV for its first parent.num_computed_tokens tokens, by the prefix cache's rule:
        a full block is shared (one more reference, as a cache hit takes), a partial one is private, so the partial
        last block is copied now (copy on write: each sample writes its next token there). Returns the (source,
        destination) block ids whose contents the caller copies; None when the pool is short."""
        table, bs = self.tables[parent.request_id], self.block_size
        full = parent.num_computed_tokens // bs
        partial = self.blocks_needed(parent.num_computed_tokens) - full
        if partial > self.pool.num_free:
            return None
        shared = table[:full]
        self.pool.touch(shared)
        copies = self.pool.allocate(partial) if partial else []
        self.tables[child.request_id] = shared + copies
        child.block_hashes = parent.block_hashes[:full]
        child.ext_hashes = parent.ext_hashes[:full]
        return [(table[full + i].block_id, b.block_id) for i, b in enumerate(copies)]

    def free(self, req: Request) -> None:
        self.pool.release(self.tables.pop(req.request_id, []))
