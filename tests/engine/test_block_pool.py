"""Block pool and KV-cache manager invariants: free + used = total, ref counts, LRU eviction, no leaks."""
from __future__ import annotations

import random

import pytest

from slofleet.engine.block_pool import BlockPool, hash_block
from slofleet.engine.errors import PoolExhausted
from slofleet.engine.kv_cache_manager import KVCacheManager
from slofleet.engine.request import Request
from slofleet.engine.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(), max_tokens=16)


def invariant(pool: BlockPool) -> None:
    used = sum(1 for b in pool.blocks if b.ref_count > 0)
    assert pool.num_free + used == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.free.values())
    assert all(pool.cached[b.block_hash] is b for b in pool.blocks if b.block_hash is not None)


def test_allocate_release_and_refuse_when_short():
    pool = BlockPool(4)
    a = pool.allocate(3)
    invariant(pool)
    with pytest.raises(PoolExhausted):
        pool.allocate(2)
    pool.release(a)
    invariant(pool)
    assert pool.num_free == 4


def test_hash_chain_depends_on_parent():
    h1 = hash_block(None, [1, 2, 3])
    assert hash_block(None, [1, 2, 3]) == h1  # stable
    assert hash_block(h1, [4, 5, 6]) != hash_block(None, [4, 5, 6])
    assert hash_block(None, [1, 2, 3], b"adapter") != h1


def test_lru_evicts_least_recently_freed_cached_block():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, bytes([i]))
    pool.release([blocks[0]])
    pool.release([blocks[2]])
    pool.release([blocks[1]])
    fresh = pool.allocate(1)[0]
    assert fresh is blocks[0] and pool.lookup(bytes([0])) is None  # oldest freed goes first
    assert pool.lookup(bytes([2])) is blocks[2]
    pool.touch([blocks[2]])  # a hit takes a free cached block out of the free list
    assert blocks[2].block_id not in pool.free
    invariant(pool)


def test_prefix_sharing_and_last_token_recomputed():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    a = req("a", prompt)
    hits, n = kv.computed_blocks(a)
    assert (hits, n) == ([], 0)
    assert kv.allocate(a, len(prompt))
    b = req("b", prompt)
    hits, n = kv.computed_blocks(b)
    assert n == 8  # full blocks only, and never the last token
    assert kv.allocate(b, len(prompt) - n, hits)
    assert kv.block_table("a")[:2] == kv.block_table("b")[:2]
    assert kv.block_table("a")[2] != kv.block_table("b")[2]
    assert [kv.pool.blocks[i].ref_count for i in kv.block_table("b")[:2]] == [2, 2]
    kv.free(a)
    kv.free(b)
    invariant(kv.pool)
    assert kv.pool.num_free == 16
    assert kv.stats.hits == 8 and kv.stats.queries == 24


def test_no_leak_under_random_allocations_and_aborts():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=64, block_size=8)
    live: list[Request] = []
    for step in range(2000):
        if live and rng.random() < 0.4:
            kv.free(live.pop(rng.randrange(len(live))))  # finish or abort
        else:
            shared = [7] * rng.choice([0, 8, 16, 24])
            r = req(f"r{step}", shared + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))])
            hits, n = kv.computed_blocks(r)
            if kv.allocate(r, r.num_tokens - n, hits):
                r.num_computed_tokens = r.num_tokens
                live.append(r)
        invariant(kv.pool)
    for r in live:
        kv.free(r)
    invariant(kv.pool)
    assert kv.pool.num_free == kv.pool.num_blocks
    assert kv.stats.hits > 0
