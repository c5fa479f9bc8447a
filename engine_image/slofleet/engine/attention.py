"""The attention interface over a paged KV cache, and its torch implementation.

Every backend takes the same flat batch: the new tokens of all sequences concatenated ([T, heads, dim]),
`slot_mapping` (where each new token's K/V goes: block_id * block_size + offset), `query_start_loc`
(prefix sums of query lengths, [B+1]), `seq_lens` (context length after this step, [B]) and
`block_tables` ([B, max_blocks]). Prefill chunks and decodes share one call. The torch backend is the
CPU path and the test oracle; the Triton kernels implement the same signature.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from . import cpu_kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padding: 0)
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Set once per batch by the torch backend and reused by every layer.
    cache: dict | None = None


class AttentionBackend(Protocol):
    """What the model calls in every layer: store the new K/V in their slots, attend, return [T, heads, dim]."""
    block_size: int

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


# K and V bytes one decode attention call gathers into the reused buffers, small enough to stay in a core's L2 until
# SDPA reads them. On a 2-core Xeon (2 MiB L2 a core) 1-4 MiB chunks ran decode attention 25-40% faster than one
# gather of the whole batch at 32-64 sequences of 512 tokens, and as fast at 16 of 128.
GATHER_BYTES = 1 << 20
# Rows with at most this many new tokens over a cached context (a decode and its draft, speculative.py) attend in the
# batched decode chunks, their queries padded to the chunk's longest; longer ones attend one by one.
SHORT_QUERY = 17


class TorchAttention:
    """Reference paged attention: scatter new K/V into their slots, then attend over each block table."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # K, V gather targets, reused every call

    @staticmethod
    def write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, kernel: bool = False) -> None:
        """The new K/V into their slots: by the CPU kernel where the plan found it takes them (kernel), else torch."""
        if kernel:
            return cpu_kernels.kv_store(k, v, k_cache, v_cache, slot_mapping)
        kvh, d = k.shape[1], k.shape[2]
        k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)

    def plan(self, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_cache: torch.Tensor) -> dict:
        """What a step's layers share (kept in meta.cache): "kernel", the rows the attention kernels take and their
        int32 arguments; "decode_chunks" and "prefill_info", the rows the torch ops take; "store", whether the
        KV-store kernel takes the new K/V."""
        if meta.cache is None:
            meta.cache = self._plan(meta, q, k, v, k_cache)
        return meta.cache

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              k_cache: torch.Tensor) -> dict:
        """Gather indices and masks shared by all layers of one step; the KV store, decodes and prefill chunks go to
        the in-place kernels where they take this model's shapes.

        Context is gathered a whole block at a time (index_select over block ids): copying 16-token runs is
        tens of times faster than indexing token slots one by one, and the tail past each length is masked.
        """
        bs, device = self.block_size, k_cache.device
        qlens, slens = meta.query_lens_host, meta.seq_lens_host
        decodes = [i for i, q in enumerate(qlens) if q == 1 or q <= SHORT_QUERY and q < slens[i]]
        prefills = sorted(set(range(len(qlens))) - set(decodes))
        kernel, decode_chunks = {}, []
        as_i32 = functools.partial(torch.as_tensor, dtype=torch.int32, device=device)
        if decodes and cpu_kernels.attention_usable(q, k_cache):
            kernel["decode"], decodes = as_i32(decodes), []
        if prefills and cpu_kernels.prefill_usable(q, k_cache):
            kernel["prefill"], prefills = as_i32(prefills), []
        if kernel:
            kernel["args"] = (meta.block_tables.to(torch.int32).contiguous(),
                              meta.query_start_loc.to(torch.int32).contiguous(), as_i32(qlens),
                              meta.seq_lens.to(torch.int32).contiguous())
        if decodes:
            decode_chunks = self._decode_chunks(meta, decodes, len(qlens), k_cache)
            rows = max(len(blocks) for _, blocks, _, _, _ in decode_chunks)
            if self.buffers is None or len(self.buffers[0]) < rows or self.buffers[0].dtype != k_cache.dtype:
                self.buffers = (k_cache.new_empty((rows, *k_cache.shape[1:])),
                                k_cache.new_empty((rows, *k_cache.shape[1:])))
        prefill_info = []
        for i in prefills:
            start, q, L = int(meta.query_start_loc[i]), qlens[i], slens[i]
            if q == L:  # nothing cached before this chunk: plain causal attention on the new K/V
                prefill_info.append((start, q, None, None))
                continue
            blocks = meta.block_tables[i, : -(-L // bs)].long()
            qpos = torch.arange(L - q, L, device=device)
            mask = torch.arange(len(blocks) * bs, device=device)[None, :] <= qpos[:, None]
            prefill_info.append((start, q, blocks, mask))
        return {"kernel": kernel, "decode_chunks": decode_chunks, "prefill_info": prefill_info,
                "store": cpu_kernels.kv_store_usable(k, v, k_cache, meta.slot_mapping)}

    def _decode_chunks(self, meta: AttentionMetadata, decodes: list[int], batch: int, k_cache: torch.Tensor) -> list:
        """(rows, blocks, mask, n, valid) per chunk of decodes. A chunk gathers at most GATHER_BYTES of K and V (or
        one sequence), each of its rows as many blocks as its longest context: the decodes go in order of length, so
        short ones pad to short ones. rows is None for one chunk of the whole batch in batch order. A chunk with
        several queries in a row has rows [n, Q] (each row's tokens, its last one repeated up to the chunk's
        longest Q) and valid [n, Q] (which of them are real); valid is None otherwise."""
        bs, slens = self.block_size, meta.seq_lens_host
        block_bytes = 2 * k_cache[0].numel() * k_cache.element_size()
        nblk = {i: -(-slens[i] // bs) for i in decodes}
        if len(decodes) * max(nblk.values()) * block_bytes <= GATHER_BYTES:
            chunks = [decodes]
        else:
            chunks, order = [], sorted(decodes, key=slens.__getitem__)
            for i in order:
                if chunks and (len(chunks[-1]) + 1) * nblk[i] * block_bytes <= GATHER_BYTES:
                    chunks[-1].append(i)
                else:
                    chunks.append([i])
        out = []
        device, qlens = k_cache.device, meta.query_lens_host
        for c in chunks:
            width = nblk[c[-1]] if len(chunks) > 1 else max(nblk.values())
            idx = torch.as_tensor(c, device=device)
            blocks = meta.block_tables[idx, :width].reshape(-1).long()
            pos = torch.arange(width * bs, device=device)
            longest, valid = max(qlens[i] for i in c), None
            if longest == 1:
                past = pos[None, :] >= meta.seq_lens[idx].long()[:, None]
                rows = None if len(c) == batch else meta.query_start_loc[idx].long()
            else:  # query j of a row of q new tokens sits at seq_len - q + j and sees the positions up to its own
                q = torch.tensor([qlens[i] for i in c], device=device)[:, None]
                j = torch.arange(longest, device=device)[None, :]
                valid, j = j < q, torch.minimum(j, q - 1)
                rows = meta.query_start_loc[idx].long()[:, None] + j
                past = pos > (meta.seq_lens[idx].long()[:, None] - q + j)[..., None]
            # additive, in the cache's dtype: SDPA would otherwise convert a boolean mask in every layer
            mask = k_cache.new_zeros(past.shape).masked_fill_(past, float("-inf"))
            out.append((rows, blocks, mask[:, None, None, :] if valid is None else mask[:, None], len(c), valid))
        return out

    @staticmethod
    def gather(cache: torch.Tensor, blocks: torch.Tensor, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, blocks_per_row * block_size, kv_heads, dim] from whole blocks (into out's first blocks if given)."""
        got = cache.index_select(0, blocks) if out is None else torch.index_select(cache, 0, blocks,
                                                                                  out=out[:len(blocks)])
        return got.view(rows, -1, cache.shape[2], cache.shape[3])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self.plan(meta, q, k, v, k_cache)
        self.write(k, v, k_cache, v_cache, meta.slot_mapping, plan["store"])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        kernel = plan["kernel"]
        for kind in ("decode", "prefill"):
            if kind in kernel:
                tables, starts, qlens, lens = kernel["args"]
                cpu_kernels.attend(kind, q, k_cache, v_cache, tables, kernel[kind], starts, qlens, lens, out, scale)
        for rows, blocks, mask, n, valid in plan["decode_chunks"]:
            kk = self.gather(k_cache, blocks, n, self.buffers[0]).transpose(1, 2)  # [B, kvh, L, d]
            vv = self.gather(v_cache, blocks, n, self.buffers[1]).transpose(1, 2)
            if valid is not None:  # several queries a row: [B, h, Q, d]
                qq = q[rows.reshape(-1)].view(n, -1, *q.shape[1:]).transpose(1, 2)
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
                out[rows[valid]] = o.transpose(1, 2)[valid]
                continue
            qq = (q if rows is None else q[rows]).unsqueeze(2)  # [B, h, 1, d]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True).squeeze(2)
            if rows is None:
                return o
            out[rows] = o
        for start, n, blocks, mask in plan["prefill_info"]:
            qq = q[start:start + n].transpose(0, 1)
            if blocks is None:
                kk, vv = k[start:start + n].transpose(0, 1), v[start:start + n].transpose(0, 1)
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
            else:
                kk = self.gather(k_cache, blocks, 1)[0].transpose(0, 1)
                vv = self.gather(v_cache, blocks, 1)[0].transpose(0, 1)
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:start + n] = o.transpose(0, 1)
        return out
