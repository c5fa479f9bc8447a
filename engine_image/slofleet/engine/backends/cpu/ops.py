"""The model's operations on the CPU: the engine's C++ kernels (cpu_kernels.py) where this CPU built them and they
take the model's dtype, torch's ops for the rest. What the kernels can do is asked once, at construction
(Capabilities); a call checks only the layout of its own tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..torch.ops import TorchOps
from . import cpu_kernels, quant
from .attention import CpuAttention
from .layer_stack import LayerStack

# Rows up to which x @ W.T runs as W @ x.T where no kernel of ours holds the weight (prepare): for a decode step's few
# rows MKL's sgemm and oneDNN's bf16 kernels stream the weight once that way (docs/kernels-notes.md).
TRANSPOSED_ROWS = {torch.float32: 32, torch.bfloat16: 256}
SILU_MIN_ROWS = 8  # below this a kernel call costs more than torch's two ops (the same bits)


@dataclass(slots=True, kw_only=True)
class Capabilities:
    """What this CPU's kernels take in the model's dtype, asked once."""
    fused: bool  # add + RMSNorm, rotary, KV store, argmax: built, and the dtype is one they know
    silu: bool  # SiLU-and-mul (bf16 on AVX-512; fp32 where the kernel has torch's own exp)

    @classmethod
    def probe(cls, dtype: torch.dtype) -> Capabilities:
        fused = cpu_kernels.load() is not None and dtype in cpu_kernels.DTYPES
        silu = fused and (cpu_kernels.has_silu_fp32() if dtype == torch.float32 else cpu_kernels.has_silu())
        return cls(fused=fused, silu=silu)


def gguf_forms(model: nn.Module) -> dict[int, quant.Form]:
    """The exact GGUF forms (quant.recover) of a model's fp32 projection weights, the LM head's included, by id of
    their layer: asked before the cast to bf16, which loses what tells them apart."""
    return {id(m): f for m in model.modules() if isinstance(m, nn.Linear) and (f := quant.recover(m.weight))}


class CpuOps(TorchOps):
    def __init__(self, block_size: int, dtype: torch.dtype):
        super().__init__(block_size, CpuAttention(block_size))
        self.dtype = dtype
        self.caps = Capabilities.probe(dtype)
        self.transposed_rows = TRANSPOSED_ROWS.get(dtype, 32)

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """By the GEMM kernel where the layer holds its panels (prepare; a contiguous result), else as W @ x.T for
        a decode step's few rows (TRANSPOSED_ROWS), whose result is a column-major view: a caller that hands it to a
        kernel or a view that needs a contiguous last dimension copies it (`.contiguous()`, free on the other paths)."""
        panels = layer.panels
        if panels is not None:
            y = cpu_kernels.gemm(x, panels)
            return y if layer.bias is None else y.add_(layer.bias)
        if x.shape[0] > TRANSPOSED_ROWS.get(x.dtype, 32):
            return nn.functional.linear(x, layer.weight, layer.bias)
        y = (layer.weight @ x.T).T
        return y if layer.bias is None else y + layer.bias

    def swiglu(self, x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
        """In the GEMM's last step where its bf16 tiles pair the two halves (prepare), so the [rows, 2 x inter]
        product is never written; else the product, then silu_mul."""
        if gate_up.paired:
            return cpu_kernels.gemm(x, gate_up.panels, silu=True)
        return self.silu_mul(self.linear(x, gate_up))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # a decode's product is column-major (linear): torch's ops take it
        if (self.caps.silu and gate_up.shape[0] >= SILU_MIN_ROWS and gate_up.stride(1) == 1
                and gate_up.dtype == self.dtype):
            return cpu_kernels.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> torch.Tensor:
        if self.caps.fused and x.is_contiguous() and x.dtype == weight.dtype == self.dtype:
            return cpu_kernels.add_rms_norm(x, delta, weight, eps)
        return super().add_rms_norm(x, delta, weight, eps)

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if (self.caps.fused and qk.dtype == self.dtype and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2]
                and qk.shape[2] <= cpu_kernels.MAX_ROPE_DIM):
            return cpu_kernels.rope(qk, cos, sin)  # in place
        return super().rotate(qk, cos, sin)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        found = cpu_kernels.argmax(logits) if self.caps.fused else None  # None: a NaN, or a layout it does not take
        return found if found is not None else super().argmax(logits)

    def forms(self, model: nn.Module, dtype: torch.dtype) -> dict[int, quant.Form]:
        """gguf_forms where a GEMM kernel of dtype unpacks them: bf16 on AVX512-BF16, with or without AMX; fp32 on
        AVX-512 or AVX2."""
        return gguf_forms(model) if cpu_kernels.unpacks(dtype) else {}

    def prepare(self, model: nn.Module, forms: dict[int, quant.Form]) -> None:
        """Where a GEMM kernel takes a projection (fp32 on AVX-512 or AVX2, bf16 on AMX or AVX512-BF16), keep its
        weight only in the kernel's packed form (the first layout is freed, so no more memory), used at every step size;
        bf16 gate/up tiles are paired, so the MLP's activation runs in their GEMM (swiglu). A layer in `forms` keeps
        its quantised form. A tied LM head's packed form is a copy: the embedding keeps its weight for the lookups.
        Then the layer stack, where the kernels take every layer's work."""
        gate_ups = {id(layer.gate_up_proj) for layer in model.layers}
        for m in model.modules():
            if not isinstance(m, nn.Linear):
                continue
            paired = id(m) in gate_ups and m.bias is None  # a bias would have to be added before the activation
            panels = cpu_kernels.pack(m.weight, paired, forms.get(id(m)))
            if panels is not None:
                m.panels, m.paired = panels, paired and cpu_kernels.form_dtype(panels) == torch.bfloat16
                if m.weight is not model.embed_tokens.weight:
                    m.weight = nn.Parameter(m.weight.new_empty(0, m.in_features), requires_grad=False)
        model.stack = LayerStack.build(model, self.attention)
