"""The attention interface over a paged KV cache, and its torch implementation.

Every backend takes the same flat batch: the new tokens of all sequences concatenated ([T, heads, dim]),
`slot_mapping` (where each new token's K/V goes: block_id * block_size + offset), `query_start_loc`
(prefix sums of query lengths, [B+1]), `seq_lens` (context length after this step, [B]) and
`block_tables` ([B, max_blocks]). Prefill chunks and decodes share one call. The torch backend is the
CPU path and the test oracle; the Triton kernels implement the same signature.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


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


class TorchAttention:
    """Reference paged attention: scatter new K/V into their slots, then attend over each block table."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    @staticmethod
    def write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        kvh, d = k.shape[1], k.shape[2]
        k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)

    def _plan(self, meta: AttentionMetadata, device: torch.device) -> dict:
        """Gather indices and masks shared by all layers of one step.

        Context is gathered a whole block at a time (index_select over block ids): copying 16-token runs is
        tens of times faster than indexing token slots one by one, and the tail past each length is masked.
        """
        bs = self.block_size
        qlens, slens = meta.query_lens_host, meta.seq_lens_host
        decodes = [i for i, q in enumerate(qlens) if q == 1]
        decode_groups = self._decode_groups(meta, decodes, len(qlens), device) if decodes else []
        prefill_info = []
        for i in (i for i, q in enumerate(qlens) if q > 1):
            start, q, L = int(meta.query_start_loc[i]), qlens[i], slens[i]
            if q == L:  # nothing cached before this chunk: plain causal attention on the new K/V
                prefill_info.append((start, q, None, None))
                continue
            blocks = meta.block_tables[i, : -(-L // bs)].long()
            qpos = torch.arange(L - q, L, device=device)
            mask = torch.arange(len(blocks) * bs, device=device)[None, :] <= qpos[:, None]
            prefill_info.append((start, q, blocks, mask))
        return {"decode_groups": decode_groups, "prefill_info": prefill_info}

    def _decode_groups(self, meta: AttentionMetadata, decodes: list[int], batch: int, device: torch.device) -> list:
        """(rows, blocks, mask, n) per group of decodes. Each decode of a group reads as many blocks as the group's
        longest context; when lengths spread widely, the shorter half goes in a group of its own, since the padding
        it saves (a quarter or more of the blocks read) costs more than a second attention call."""
        bs, slens = self.block_size, meta.seq_lens_host
        groups = [decodes]  # in batch order: a lone group of every row is returned as it is
        order = sorted(decodes, key=lambda i: slens[i])
        half = len(order) // 2
        if half >= 2 and 4 * half * (slens[order[-1]] - slens[order[half - 1]]) >= len(order) * slens[order[-1]]:
            groups = [order[:half], order[half:]]
        out = []
        for g in groups:
            nblk = -(-max(slens[i] for i in g) // bs)
            idx = torch.as_tensor(g, device=device)
            blocks = meta.block_tables[idx, :nblk].reshape(-1).long()
            pos = torch.arange(nblk * bs, device=device)
            mask = (pos[None, :] < meta.seq_lens[idx].long()[:, None])[:, None, None, :]
            rows = None if len(g) == batch else meta.query_start_loc[idx].long()
            out.append((rows, blocks, mask, len(g)))
        return out

    @staticmethod
    def gather(cache: torch.Tensor, blocks: torch.Tensor, rows: int) -> torch.Tensor:
        """[rows, blocks_per_row * block_size, kv_heads, dim] from whole blocks."""
        return cache.index_select(0, blocks).view(rows, -1, cache.shape[2], cache.shape[3])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.cache is None:
            meta.cache = self._plan(meta, q.device)
        plan = meta.cache
        out = torch.empty_like(q)
        for rows, blocks, mask, n in plan["decode_groups"]:
            kk = self.gather(k_cache, blocks, n).transpose(1, 2)  # [B, kvh, L, d]
            vv = self.gather(v_cache, blocks, n).transpose(1, 2)
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
