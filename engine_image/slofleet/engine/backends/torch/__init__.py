"""The torch backend: every operation in plain torch ops, the reference the other backends are tested against."""
from .attention import TorchAttention
from .ops import TorchOps

__all__ = ["TorchAttention", "TorchOps"]
