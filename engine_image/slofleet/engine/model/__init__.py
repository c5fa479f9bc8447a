"""The model, written once against the backends' operations (backends/ops.py)."""
from .llama import SUPPORTED_ARCHITECTURES, CausalLM, DecoderLayer, RMSNorm
from .rotary import Rotary, inv_frequencies, rope_settings

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "DecoderLayer", "RMSNorm", "Rotary", "inv_frequencies",
           "rope_settings"]
