"""The model's operations on a GPU: attention in Triton, the other operations as the torch reference runs them."""
from __future__ import annotations

from ..torch.ops import TorchOps
from .attention import TritonAttention


class TritonOps(TorchOps):
    def __init__(self, block_size: int):
        super().__init__(block_size, TritonAttention(block_size))
