"""Reference paged attention in torch: the test oracle, and the CPU backend's path for what its kernels do not take.

The plan (plan.py) is made once per step on the host from the metadata's `*_host` lists and shared by every layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import AttentionMetadata
from ..plan import AttentionPlan, DecodeChunk, KernelRows, PrefillRows

# K and V bytes one decode attention call gathers into the reused buffers, small enough to stay in a core's L2 until
# SDPA reads them (docs/kernels-notes.md has the measurements).
GATHER_BYTES = 1 << 20
# Rows with at most this many new tokens over a cached context (a decode and its draft, speculative.py) attend in the
# batched decode chunks, their queries padded to the chunk's longest; longer ones attend one by one.
SHORT_QUERY = 17


class TorchAttention:
    """Reference paged attention: scatter new K/V into their slots, then attend over each block table. Subclasses
    send rows to kernels (take, store, attend_kernel)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # K, V gather targets, reused every call

    @staticmethod
    def write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        kvh, d = k.shape[1], k.shape[2]
        k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)

    def take(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, decodes: list[int],
             prefills: list[int]) -> KernelRows | None:
        """The rows a kernel takes (removed from decodes and prefills); none here."""
        return None

    def stores(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor) -> bool:
        """Whether a kernel stores the new K/V; torch's index_copy does here."""
        return False

    def attend_kernel(self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
                      scale: float) -> None:
        """Store the new K/V and attend the plan's kernel rows into out."""
        self.write(k, v, k_cache, v_cache, meta.slot_mapping)

    def plan(self, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_cache: torch.Tensor) -> AttentionPlan:
        """What a step's layers share, made by the first layer and kept in meta.plan."""
        if meta.plan is None:
            meta.plan = self._plan(meta, q, k, v, k_cache)
        return meta.plan

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              k_cache: torch.Tensor) -> AttentionPlan:
        """Gather indices and masks shared by all layers of one step, for the rows no kernel takes.

        Context is gathered a whole block at a time (index_select over block ids): copying 16-token runs is
        tens of times faster than indexing token slots one by one, and the tail past each length is masked.
        """
        qlens, slens = meta.query_lens_host, meta.seq_lens_host
        decodes = [i for i, q in enumerate(qlens) if q == 1 or q <= SHORT_QUERY and q < slens[i]]
        prefills = sorted(set(range(len(qlens))) - set(decodes))
        plan = AttentionPlan(kernel=self.take(meta, q, k_cache, decodes, prefills))
        if decodes:
            plan.decode_chunks = self._decode_chunks(meta, decodes, len(qlens), k_cache)
            rows = max(len(c.blocks) for c in plan.decode_chunks)
            if self.buffers is None or len(self.buffers[0]) < rows or self.buffers[0].dtype != k_cache.dtype:
                self.buffers = (k_cache.new_empty((rows, *k_cache.shape[1:])),
                                k_cache.new_empty((rows, *k_cache.shape[1:])))
        plan.prefills = [self._prefill(meta, i, k_cache.device) for i in prefills]
        plan.store = self.stores(k, v, k_cache, meta.slot_mapping)
        return plan

    def _prefill(self, meta: AttentionMetadata, i: int, device: torch.device) -> PrefillRows:
        start, q, L = int(meta.query_start_loc[i]), meta.query_lens_host[i], meta.seq_lens_host[i]
        if q == L:  # nothing cached before this chunk: plain causal attention on the new K/V
            return PrefillRows(start=start, n=q, blocks=None, mask=None)
        blocks = meta.block_tables[i, : -(-L // self.block_size)].long()
        qpos = torch.arange(L - q, L, device=device)
        mask = torch.arange(len(blocks) * self.block_size, device=device)[None, :] <= qpos[:, None]
        return PrefillRows(start=start, n=q, blocks=blocks, mask=mask)

    def _decode_chunks(self, meta: AttentionMetadata, decodes: list[int], batch: int, k_cache: torch.Tensor
                       ) -> list[DecodeChunk]:
        """The chunks of decodes (DecodeChunk). A chunk gathers at most GATHER_BYTES of K and V (or
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
            out.append(DecodeChunk(rows=rows, blocks=blocks, mask=mask[:, None, None, :] if valid is None else
                                   mask[:, None], n=len(c), valid=valid))
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
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.attend_kernel(plan, q, k, v, k_cache, v_cache, meta, out, scale)
        for c in plan.decode_chunks:
            kk = self.gather(k_cache, c.blocks, c.n, self.buffers[0]).transpose(1, 2)  # [B, kvh, L, d]
            vv = self.gather(v_cache, c.blocks, c.n, self.buffers[1]).transpose(1, 2)
            if c.valid is not None:  # several queries a row: [B, h, Q, d]
                qq = q[c.rows.reshape(-1)].view(c.n, -1, *q.shape[1:]).transpose(1, 2)
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=c.mask, scale=scale, enable_gqa=True)
                out[c.rows[c.valid]] = o.transpose(1, 2)[c.valid]
                continue
            qq = (q if c.rows is None else q[c.rows]).unsqueeze(2)  # [B, h, 1, d]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=c.mask, scale=scale, enable_gqa=True).squeeze(2)
            if c.rows is None:
                return o
            out[c.rows] = o
        for p in plan.prefills:
            out[p.start:p.start + p.n] = self._attend_prefill(p, q, k, v, k_cache, v_cache, scale)
        return out

    def _attend_prefill(self, p: PrefillRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        qq = q[p.start:p.start + p.n].transpose(0, 1)
        if p.blocks is None:
            kk, vv = k[p.start:p.start + p.n].transpose(0, 1), v[p.start:p.start + p.n].transpose(0, 1)
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kk = self.gather(k_cache, p.blocks, 1)[0].transpose(0, 1)
            vv = self.gather(v_cache, p.blocks, 1)[0].transpose(0, 1)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=p.mask, scale=scale, enable_gqa=True)
        return o.transpose(0, 1)
