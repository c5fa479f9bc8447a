"""TritonAttention against TorchAttention (the oracle) on random paged batches."""
from __future__ import annotations

import os
import random

import pytest
import torch

from slofleet.engine.backends.ops import AttentionMetadata
from slofleet.engine.backends.torch import attention
from slofleet.engine.backends.torch.attention import TorchAttention
from slofleet.engine.backends.triton.attention import TritonAttention

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


def make_batch(spans: list[tuple[int, int]], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               seed: int, extra_blocks: int = 3):
    """spans: (query_len, seq_len) per sequence. Blocks come from a shuffled pool, so tables are scattered."""
    rng = random.Random(seed)
    need = [-(-s // block_size) for _, s in spans]
    pool = list(range(sum(need) + extra_blocks))
    rng.shuffle(pool)
    tables, slots = [], []
    for (q, s), n in zip(spans, need):
        table, pool = pool[:n], pool[n:]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    width = max(need)
    qsl = [0]
    for q, _ in spans:
        qsl.append(qsl[-1] + q)
    dev = DEVICE
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([s for _, s in spans], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
        max_query_len=max(q for q, _ in spans), max_seq_len=max(s for _, s in spans),
        query_lens_host=[q for q, _ in spans], seq_lens_host=[s for _, s in spans])
    num_blocks = sum(need) + extra_blocks
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn((num_blocks, block_size, kv_heads, head_dim), generator=gen).to(dev, dtype)
                        for _ in range(2))
    return meta, k_cache, v_cache


def run_both(spans, block_size, heads, kv_heads, head_dim, dtype, seed, backend=None):
    meta, k_cache, v_cache = make_batch(spans, block_size, kv_heads, head_dim, dtype, seed)
    t = sum(q for q, _ in spans)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn((t, heads, head_dim), generator=gen).to(DEVICE, dtype)
    # k and v as strided views of one fused projection, the way model.py hands them over
    kv = torch.randn((t, 2 * kv_heads * head_dim), generator=gen).to(DEVICE, dtype)
    k, v = (x.view(t, kv_heads, head_dim) for x in kv.split(kv_heads * head_dim, dim=-1))
    scale = head_dim ** -0.5
    backend = backend or TritonAttention(block_size)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = backend.forward(q, k, v, kc, vc, meta, scale)
    # The oracle runs in fp32 on the same (rounded) inputs.
    rk, rv = k_cache.float(), v_cache.float()
    ref = TorchAttention(block_size).forward(q.float(), k.float(), v.float(), rk, rv, meta, scale)
    torch.testing.assert_close(kc.float(), rk, atol=0, rtol=0)
    torch.testing.assert_close(vc.float(), rv, atol=0, rtol=0)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    return out


MIXED = [(1, 37), (23, 23), (1, 1), (9, 70), (1, 16), (33, 33), (17, 33)]  # decodes, prefills, chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 2), (2, 2)])
def test_mixed_batch(dtype, block_size, heads, kv_heads):
    run_both(MIXED, block_size, heads, kv_heads, 32, dtype, seed=block_size + heads)


@pytest.mark.parametrize("seed", range(3))
def test_random_ragged(seed):
    rng = random.Random(seed)
    spans = []
    for _ in range(rng.randint(1, 6)):
        s = rng.randint(1, 90)
        spans.append((rng.choice([1, rng.randint(1, s)]), s))
    run_both(spans, rng.choice([16, 32]), 8, 2, 64, torch.float32, seed=seed)


def test_decode_only_and_bf16():
    run_both([(1, 5), (1, 64), (1, 33)], 16, 4, 1, 32, torch.float32, seed=7)
    run_both([(1, 50), (12, 40)], 16, 4, 2, 32, torch.bfloat16, seed=8)


def split_backend(block_size: int) -> TritonAttention:
    backend = TritonAttention(block_size, split_min_len=0, max_splits=4)
    backend.target_programs = 1 << 20  # as many splits as max_splits allows, as on a large GPU
    return backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_split_kv_decode(dtype, block_size):
    spans = [(1, 600), (1, 71), (1, 1), (1, 300)]  # short ones leave some splits empty
    backend = split_backend(block_size)
    meta, _, _ = make_batch(spans, block_size, 2, 32, dtype, seed=0)
    assert backend.num_splits(meta, len(spans), 2) == 2  # 600 // 256 caps it
    run_both(spans, block_size, 8, 2, 32, dtype, seed=block_size, backend=backend)


def test_split_policy():
    backend = split_backend(16)
    meta, _, _ = make_batch([(1, 2000)], 16, 2, 32, torch.float32, seed=0)
    assert backend.num_splits(meta, 1, 2) == 4
    meta.max_query_len = 5  # a batch with a prefill chunk never splits
    assert backend.num_splits(meta, 1, 2) == 1


@pytest.mark.parametrize("splits", [False, True])
def test_padding_rows_are_inert(splits):
    """CUDA-graph padding: slot -1 writes nothing, seq_len 0 gives zeros (not NaN)."""
    spans = [(1, 520), (1, 520)]
    meta, k_cache, v_cache = make_batch(spans, 16, 2, 32, torch.float32, seed=3)
    meta.slot_mapping[1] = -1
    meta.seq_lens[1] = 0
    q = torch.randn((2, 4, 32), device=DEVICE)
    k, v = torch.randn((2, 2, 32), device=DEVICE), torch.randn((2, 2, 32), device=DEVICE)
    backend = split_backend(16) if splits else TritonAttention(16)
    assert (backend.num_splits(meta, 2, 2) > 1) == splits
    kc = k_cache.clone()
    out = backend.forward(q, k, v, kc, v_cache.clone(), meta, 0.2)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert (kc.view(-1, 2, 32)[meta.slot_mapping[0]] == k[0]).all()
    assert (kc.view(-1, 2, 32).ne(k_cache.view(-1, 2, 32)).any(-1).any(-1)).sum() == 1


@pytest.mark.parametrize("gather_bytes", [1 << 20, 100 << 10, 1])  # one chunk of decodes, a few, one per sequence
@pytest.mark.parametrize("spans", [
    [(1, 300), (1, 20), (1, 250), (1, 35), (1, 40), (1, 280)],  # spread lengths
    [(1, 90), (1, 80), (1, 100), (1, 85)],  # close lengths
    [(1, 300), (7, 60), (1, 20), (1, 310), (1, 15)],  # decodes around a prefill chunk
    [(5, 300), (1, 20), (3, 250), (5, 35), (17, 40), (1, 280), (20, 60), (4, 4)],  # drafts among decodes and prompts
])
def test_torch_oracle_matches_dense_attention(spans, gather_bytes, monkeypatch):
    """The oracle itself, against plain causal attention over each sequence's whole context, gathered slot by slot."""
    monkeypatch.setattr(attention, "GATHER_BYTES", gather_bytes)
    block_size, heads, kv_heads, dim = 16, 6, 2, 32
    meta, k_cache, v_cache = make_batch(spans, block_size, kv_heads, dim, torch.float32, seed=len(spans))
    total = sum(q for q, _ in spans)
    gen = torch.Generator(device="cpu").manual_seed(11)
    q, k, v = (torch.randn((total, n, dim), generator=gen).to(DEVICE) for n in (heads, kv_heads, kv_heads))
    out = TorchAttention(block_size).forward(q, k, v, k_cache, v_cache, meta, 0.3)
    tables, starts = meta.block_tables.tolist(), meta.query_start_loc.tolist()
    for i, (n, s) in enumerate(spans):
        slots = torch.tensor([tables[i][p // block_size] * block_size + p % block_size for p in range(s)],
                             device=DEVICE)
        kk = k_cache.view(-1, kv_heads, dim)[slots].transpose(0, 1)
        vv = v_cache.view(-1, kv_heads, dim)[slots].transpose(0, 1)
        mask = torch.arange(s, device=DEVICE)[None, :] <= torch.arange(s - n, s, device=DEVICE)[:, None]
        qq = q[starts[i]:starts[i] + n].transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[starts[i]:starts[i] + n], ref.transpose(0, 1), atol=1e-5, rtol=1e-5)
