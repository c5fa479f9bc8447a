"""The attention plan: what a step's layers share, made once per step from the metadata (backends/torch/attention.py).

Rows go to the CPU kernels (KernelRows) or to torch's ops: decodes in chunks over gathered blocks (DecodeChunk),
prefill chunks one by one (PrefillRows).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True, kw_only=True)
class KernelRows:
    """The batch rows the attention kernels take, with the int32 arguments they share (one entry per batch row)."""
    decode: torch.Tensor | None  # int32 rows of a few queries over their context
    prefill: torch.Tensor | None  # int32 rows of prefill chunks
    tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    starts: torch.Tensor  # [B] int32 query starts
    qlens: torch.Tensor  # [B] int32 query lengths
    lens: torch.Tensor  # [B] int32 context lengths after the step


@dataclass(slots=True, kw_only=True)
class DecodeChunk:
    """Decodes attended together over their gathered blocks, each row padded to the chunk's longest context."""
    rows: torch.Tensor | None  # the chunk's query rows: [n] (one query a row), [n, Q] (several), None (whole batch)
    blocks: torch.Tensor  # block ids to gather, n x width
    mask: torch.Tensor  # additive, in the cache's dtype
    n: int  # sequences in the chunk
    valid: torch.Tensor | None  # [n, Q]: which of a row's padded queries are real; None with one query a row


@dataclass(slots=True, kw_only=True)
class PrefillRows:
    """One prefill chunk: its query rows start:start + n, over its blocks (None: nothing cached before it)."""
    start: int
    n: int
    blocks: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True, kw_only=True)
class AttentionPlan:
    kernel: KernelRows | None = None
    decode_chunks: list[DecodeChunk] = field(default_factory=list)
    prefills: list[PrefillRows] = field(default_factory=list)
    store: bool = False  # whether the KV-store kernel takes the new K/V

    @property
    def all_kernel(self) -> bool:
        """Whether every row and the KV store go to the kernels."""
        return self.kernel is not None and self.store and not self.decode_chunks and not self.prefills
