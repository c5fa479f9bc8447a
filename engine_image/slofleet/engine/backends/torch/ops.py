"""The model's operations in plain torch: the reference, and what a backend runs where its kernels do not apply."""
from __future__ import annotations

import torch
from torch import nn

from ..ops import AttentionBackend
from .attention import TorchAttention


class TorchOps:
    def __init__(self, block_size: int, attention: AttentionBackend | None = None):
        self.attention = attention if attention is not None else TorchAttention(block_size)

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        return nn.functional.linear(x, layer.weight, layer.bias)

    def swiglu(self, x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
        return self.silu_mul(self.linear(x, gate_up))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate).mul_(up)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> torch.Tensor:
        if delta is not None:
            x.add_(delta)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Rotate-half convention, as in the Hugging Face checkpoints: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s], in fp32.
        xf = qk.float()
        return xf.roll(xf.shape[-1] // 2, -1).mul_(sin).add_(xf * cos).to(qk.dtype)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # in the logits' own dtype and device (widening is exact, so the same index): only the indices travel
        return logits.max(-1).indices.cpu()

    def forms(self, model: nn.Module, dtype: torch.dtype) -> dict:
        return {}

    def prepare(self, model: nn.Module, forms: dict) -> None:
        model.stack = None
