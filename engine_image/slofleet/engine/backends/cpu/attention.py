"""Paged attention on the CPU: the torch reference's plan, with the KV store, decodes and prefill chunks sent to the
in-place kernels (paged_attention.cpp, prefill_attention.cpp, tile_attention.cpp) where they take the model's shapes.
What they do not take runs torch's ops, as in the reference."""
from __future__ import annotations

import functools

import torch

from ..ops import AttentionMetadata
from ..plan import AttentionPlan, KernelRows
from ..torch.attention import TorchAttention
from . import cpu_kernels


class CpuAttention(TorchAttention):
    def take(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, decodes: list[int],
             prefills: list[int]) -> KernelRows | None:
        as_i32 = functools.partial(torch.as_tensor, dtype=torch.int32, device=k_cache.device)
        decode = prefill = None
        if decodes and cpu_kernels.attention_usable(q, k_cache):
            decode = as_i32(decodes)
            decodes.clear()
        if prefills and cpu_kernels.prefill_usable(q, k_cache):
            prefill = as_i32(prefills)
            prefills.clear()
        if decode is None and prefill is None:
            return None
        return KernelRows(decode=decode, prefill=prefill, tables=meta.block_tables.to(torch.int32).contiguous(),
                          starts=meta.query_start_loc.to(torch.int32).contiguous(),
                          qlens=as_i32(meta.query_lens_host), lens=meta.seq_lens.to(torch.int32).contiguous())

    def stores(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor) -> bool:
        return cpu_kernels.kv_store_usable(k, v, k_cache, slots)

    def attend_kernel(self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
                      scale: float) -> None:
        if plan.store:
            cpu_kernels.kv_store(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            self.write(k, v, k_cache, v_cache, meta.slot_mapping)
        rows = plan.kernel
        if rows is None:
            return
        for kind, which in (("decode", rows.decode), ("prefill", rows.prefill)):
            if which is not None:
                cpu_kernels.attend(kind, q, k_cache, v_cache, rows.tables, which, rows.starts, rows.qlens, rows.lens,
                                   out, scale)
