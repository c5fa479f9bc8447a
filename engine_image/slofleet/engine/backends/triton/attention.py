"""Triton paged attention: the GPU backend of the attention interface (backends/ops.py).

Three kernels:
- `_store_kv`: writes each new token's K/V into its slot (slot < 0 is a padding row and is skipped, which
  CUDA-graph replay relies on).
- `_paged_attention`: one launch for a mixed batch. Each program owns BLOCK_Q query tokens of one sequence
  times the GROUP query heads that share one KV head (GQA), so K/V tiles are read once per group; it walks
  the sequence's block table directly, with no gather into a contiguous copy.
- `_split_kv_decode` + `_merge_splits`: for decode-only batches, each (sequence, KV head) is also split
  along the context, so a small batch of long sequences still fills the GPU; partial results are merged
  with their log-sum-exp.

Softmax runs online in fp32 in base 2 (exp2 with log2(e) folded into the scale). bf16 inputs are cast to
fp32 inside the kernels; fp16 dots run natively with fp32 accumulation; fp32 runs with ieee dots so the
compiled kernels agree with the torch oracle as tightly as the interpreter does.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Without a GPU the kernels can only run in Triton's interpreter (tests, CPU smoke runs). Triton reads
    # the switch when it is first imported, so this works where nothing imported triton before us.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ..ops import AttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _store_kv(k, v, k_cache, v_cache, slots, stride_kt, stride_kh, stride_vt, stride_vh,
              stride_cs, stride_ch, KVH: tl.constexpr, HEAD_DIM: tl.constexpr,
              KVH_PAD: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    if slot < 0:
        return
    h = tl.arange(0, KVH_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < KVH) & (d < HEAD_DIM)
    dst = slot * stride_cs + h * stride_ch + d
    tl.store(k_cache + dst, tl.load(k + t * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
    tl.store(v_cache + dst, tl.load(v + t * stride_vt + h * stride_vh + d, mask=mask), mask=mask)


@triton.jit
def _attend_tile(acc, m_i, l_i, qv, k_cache, v_cache, table_row, kv_head, n, nmask, valid, qk_scale,
                 stride_cb, stride_cs, stride_ch, d, dmask,
                 BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over keys at positions n [BLOCK_N]; valid [BLOCK_M, BLOCK_N] is the causal mask."""
    blk = tl.load(table_row + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    base = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kt = tl.load(k_cache + base[None, :] + d[:, None], mask=dmask[:, None] & nmask[None, :], other=0.0)
    vt = tl.load(v_cache + base[:, None] + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    s = tl.dot(qv, kt, input_precision=PRECISION) * qk_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
    return acc, m_new, l_i


# Batch-dependent integers are not specialised on, so a new batch shape never triggers a recompile.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, qk_scale, num_seqs,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Sequence i owns programs [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): at least as many as its
    # query blocks, so the grid (T // BLOCK_Q + B) depends only on the batch's shape. Binary search for ours.
    lo = pid * 0  # a tensor even when the loop below does not run
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = tl.load(query_start_loc + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    q_start = tl.load(query_start_loc + lo)
    q_len = tl.load(query_start_loc + lo + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + lo)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + lo)
    context = seq_len - q_len  # the chunk's queries are the last q_len positions

    m = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + m // GROUP
    head = kv_head * GROUP + m % GROUP
    rmask = (m < BLOCK_Q * GROUP) & (qi < q_len)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    row = (q_start + qi).to(tl.int64)
    qv = tl.load(q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=rmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        qv = qv.to(tl.float32)
    q_pos = context + qi
    kv_end = tl.minimum(seq_len, context + (q_block + 1) * BLOCK_Q)  # nothing past the block's last query

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_row = block_tables + lo.to(tl.int64) * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < kv_end
        valid = (n[None, :] <= q_pos[:, None]) & nmask[None, :]
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, qv, k_cache, v_cache, table_row, kv_head, n, nmask, valid,
                                     qk_scale, stride_cb, stride_cs, stride_ch, d, dmask,
                                     BLOCK_SIZE, UPCAST, PRECISION)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             acc.to(out.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["stride_bt"])
def _split_kv_decode(part_out, part_lse, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, qk_scale,
                     stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens + seq)
    # Splits cover whole tiles; the split length follows this sequence's length, so one compiled kernel
    # (and one captured CUDA graph) serves any mix of lengths.
    per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS) * BLOCK_N
    begin = split * per_split
    end = tl.minimum(seq_len, begin + per_split)

    g = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + g
    rmask = g < GROUP
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    row = tl.load(query_start_loc + seq).to(tl.int64)
    qv = tl.load(q + row * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=rmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        qv = qv.to(tl.float32)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_row = block_tables + seq.to(tl.int64) * stride_bt
    for start in range(begin, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < end
        valid = rmask[:, None] & nmask[None, :]
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, qv, k_cache, v_cache, table_row, kv_head, n, nmask, valid,
                                     qk_scale, stride_cb, stride_cs, stride_ch, d, dmask,
                                     BLOCK_SIZE, UPCAST, PRECISION)
    # An empty split (or a padding row) gets lse = -inf: weight 0 in the merge.
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    part = (seq * num_heads + head) * NUM_SPLITS + split
    tl.store(part_lse + part, lse, mask=rmask)
    tl.store(part_out + part[:, None] * HEAD_DIM + d[None, :], acc, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _merge_splits(out, part_out, part_lse, query_start_loc, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + s
    lse = tl.load(part_lse + part, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    o = tl.load(part_out + part[:, None] * HEAD_DIM + d[None, :],
                mask=(s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    row = tl.load(query_start_loc + seq).to(tl.int64)
    tl.store(out + row * stride_ot + head * stride_oh + d, res.to(out.dtype.element_ty), mask=d < HEAD_DIM)


class TritonAttention:
    """Same interface as TorchAttention; every shape decision uses tensors or the metadata's two maxima only,
    so a decode step can be captured in a CUDA graph and replayed with other lengths and block tables."""

    def __init__(self, block_size: int, split_min_len: int = 1024, max_splits: int = 16):
        self.block_size = block_size
        self.split_min_len = split_min_len  # shorter decodes fill the GPU well enough without splitting
        self.max_splits = max_splits
        # Enough programs to cover every SM a few times over; 0 where there is no GPU (interpreter).
        self.target_programs = (4 * torch.cuda.get_device_properties(0).multi_processor_count
                                if torch.cuda.is_available() else 0)
        # Decode is bandwidth-bound: keys per loop iteration and warps per program set the bytes in flight.
        # Defaults: the fewest registers without spills when compiled for sm_90 (cuobjdump -res-usage).
        self.decode_tile, self.decode_warps = 32, 8

    def num_splits(self, meta: AttentionMetadata, num_seqs: int, kv_heads: int) -> int:
        if meta.max_query_len > 1 or meta.max_seq_len < self.split_min_len:
            return 1
        want = triton.cdiv(self.target_programs, num_seqs * kv_heads)
        return max(1, min(self.max_splits, want, meta.max_seq_len // 256))  # >= 256 keys per split

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        d_pad = triton.next_power_of_2(head_dim)
        _store_kv[(num_tokens,)](k, v, k_cache, v_cache, meta.slot_mapping, k.stride(0), k.stride(1),
                                 v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
                                 KVH=kv_heads, HEAD_DIM=head_dim, KVH_PAD=triton.next_power_of_2(kv_heads),
                                 D_PAD=d_pad)
        out = torch.empty_like(q)
        group = num_heads // kv_heads
        num_seqs = meta.seq_lens.shape[0]
        decode = meta.max_query_len == 1
        common = dict(GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=self.block_size,
                      UPCAST=q.dtype == torch.bfloat16, PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
        tables = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
        strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0))
        qk_scale = scale * LOG2E
        splits = self.num_splits(meta, num_seqs, kv_heads)
        if splits > 1:
            part_out = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
            _split_kv_decode[(num_seqs, kv_heads, splits)](
                part_out, part_lse, q, k_cache, v_cache, *tables, qk_scale, q.stride(0), q.stride(1), *strides,
                BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=self.decode_tile, NUM_SPLITS=splits,
                num_warps=self.decode_warps, **common)
            _merge_splits[(num_seqs, num_heads)](out, part_out, part_lse, meta.query_start_loc, out.stride(0),
                                                 out.stride(1), HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=splits,
                                                 S_PAD=triton.next_power_of_2(splits))
            return out
        # Decodes need few query rows per program; prefill chunks want tall tiles for the dots.
        block_m = max(16 if decode else 64, triton.next_power_of_2(group))
        block_q = block_m // group
        _paged_attention[(num_tokens // block_q + num_seqs, kv_heads)](
            out, q, k_cache, v_cache, *tables, qk_scale, num_seqs, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), *strides, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=self.decode_tile if decode else 32,
            num_warps=self.decode_warps if decode else 4, **common)
        return out
