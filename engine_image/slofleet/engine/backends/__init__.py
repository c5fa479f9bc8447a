"""Backends under the model: each implements the operations of backends/ops.py.

- torch: plain torch ops, the reference the tests compare with;
- triton: the GPU backend (Triton attention, CUDA graphs);
- cpu: the engine's C++ kernels, with torch's ops where they do not apply.

The runner picks one once, at load (`pick`).
"""
from __future__ import annotations

import torch

from .ops import AttentionBackend, AttentionMetadata, LayerRun, Ops

__all__ = ["AttentionBackend", "AttentionMetadata", "LayerRun", "Ops", "pick"]


def pick(device: torch.device, dtype: torch.dtype, block_size: int) -> Ops:
    """The backend for this device and model dtype; imported here so the CPU path never imports triton."""
    if device.type == "cuda":
        from .triton.ops import TritonOps
        return TritonOps(block_size)
    if device.type == "cpu":
        from .cpu.ops import CpuOps
        return CpuOps(block_size, dtype)
    from .torch.ops import TorchOps
    return TorchOps(block_size)
