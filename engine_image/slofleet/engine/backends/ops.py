"""What the model asks of a backend: a few typed operations, and attention over a paged KV cache.

The model (engine/model) is written once against `Ops`; a backend (torch, triton, cpu) implements it and is picked
once at load (backends.pick). Every attention backend takes the same flat batch: the new tokens of all sequences
concatenated ([T, heads, dim]) and the `AttentionMetadata` of the step. Prefill chunks and decodes share one call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from .plan import AttentionPlan


@dataclass(slots=True)  # positional too: benchmarks and graphs build it in order
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token's K/V
    query_start_loc: torch.Tensor  # [B+1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padding: 0)
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Made once per step by a host-planning backend (torch, cpu) and shared by every layer.
    plan: AttentionPlan | None = None


class AttentionBackend(Protocol):
    """What the model calls in every layer: store the new K/V in their slots, attend, return [T, heads, dim]."""
    block_size: int

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class LayerRun(Protocol):
    """A backend's run of a whole step's decoder layers in one go: (x, delta) as the layers' loop gives them, or None
    where this step is not one it takes (the loop runs it)."""

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor] | None: ...


class Ops(Protocol):
    """The operations a decoder layer is made of. Each answers as the torch reference does (backends/torch/ops.py);
    a backend chooses its kernels once, at construction and in `prepare`, never in the model."""
    attention: AttentionBackend

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """x @ W.T (+ b); the result may be a column-major view (element-wise ops take it as it is)."""
        ...

    def swiglu(self, x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up projection of x."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> torch.Tensor:
        """x += delta in place (delta may be None), then RMSNorm(x) * weight into a new tensor."""
        ...

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of [rows, heads, dim], in place where the backend can; returns the result."""
        ...

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum, as torch.max(-1).indices gives it, on the CPU."""
        ...

    def prepare(self, model: nn.Module, forms: dict) -> None:
        """After the weights are loaded and cast: lay them out for this backend's kernels (forms: see
        backends/cpu/quant.py) and set model.stack where it runs a step's layers in one go."""
        ...

    def forms(self, model: nn.Module, dtype: torch.dtype) -> dict:
        """Before the cast to dtype: what `prepare` needs to see of the original weights (empty for most)."""
        ...
