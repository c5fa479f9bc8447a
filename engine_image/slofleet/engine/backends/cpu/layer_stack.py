"""A step's decoder layers as one call into the CPU kernels (layer_stack.cpp), where every layer's work goes to them.

The model's Python layer calls nine kernels a layer through ctypes, each behind its argument checks, views and output
allocation: at a decode step's few rows that glue cost as much as a kernel. Here the kernels and their buffers are the
same and run in the same order, so the bits are the same; what is left in Python is one plan and one call a step.
Taken where every projection is in a GEMM kernel's packed form with no bias: bf16 in a bf16 kernel's (gate/up paired;
steps of at most cpu_kernels.DIRECT_ROWS tokens, beyond which a quantised form is unpacked whole first and the glue is
a small share of the step anyway), or fp32 in small_gemm's (plain panels or GGUF forms; gate/up's product then the
SiLU kernel, which needs torch's exp: cpu_kernels.has_silu_fp32); and where every row of the step goes to the
attention kernels and the KV-store kernel.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_kernels
from .attention import CpuAttention

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
GEMMS = {"tile_gemm": 1, "dot_gemm": 2, "small_gemm": 3}  # layer_stack.cpp's StackShape.gemm


class Shape(ctypes.Structure):
    _fields_ = [(n, _i64) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter", "block_size", "gemm",
                                    "prefill", "threads")] + [("eps", _f32), ("scale", _f32)]


class Layer(ctypes.Structure):
    _fields_ = [(n, _ptr) for n in ("in_norm", "post_norm", "qkv", "o", "gate_up", "down", "k_cache", "v_cache")] + [
        (n, _i64) for n in ("qkv_form", "o_form", "gate_up_form", "down_form")]


class Step(ctypes.Structure):
    _fields_ = [(n, _ptr) for n in ("x", "delta", "h", "qkv", "attn", "act", "gate_up", "cos", "sin", "slots",
                                    "tables", "decodes", "prefills", "starts", "qlens", "lens")] + [
        (n, _i64) for n in ("tokens", "table_stride", "n_decodes", "n_prefills")]


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(slots=True, kw_only=True)
class LayerStack:
    attention: CpuAttention  # whose plan sends rows to the kernels
    dtype: torch.dtype  # of the weights' kernel, and so of every step's rows
    shape: Shape
    table: ctypes.Array  # one Layer a decoder layer; its caches set by bind()
    bound: list | None = None  # the kv caches the table points at

    @classmethod
    def build(cls, model, attention: CpuAttention) -> LayerStack | None:
        """The stack of a packed model (CpuOps.prepare), or None where some layer's work is not all the kernels'."""
        layers = list(model.layers)
        first = layers[0]
        dtype = first.input_layernorm.weight.dtype
        kernel = None  # asked for the weights' dtype only: fp32's asks torch's exp and probes it
        if dtype == torch.bfloat16:
            kernel = cpu_kernels.bf16_gemm()
        elif dtype == torch.float32 and cpu_kernels.has_silu_fp32():
            kernel = "small_gemm"
        if kernel not in GEMMS:
            return None
        for layer in layers:
            linears = [getattr(layer, name) for name in PROJECTIONS]
            if (any(m.panels is None or m.bias is not None or cpu_kernels.form_dtype(m.panels) != dtype
                    for m in linears) or layer.gate_up_proj.paired != (dtype == torch.bfloat16)
                    or layer.head_dim > cpu_kernels.MAX_ROPE_DIM):
                return None
        prefill = cpu_kernels.prefill_kernel(dtype, first.n_heads, first.n_kv, first.head_dim)
        shape = Shape(hidden=first.o_proj.out_features, heads=first.n_heads, kv_heads=first.n_kv,
                      head_dim=first.head_dim, inter=first.down_proj.in_features,
                      block_size=attention.block_size, gemm=GEMMS[kernel], prefill=int(prefill == "tile_prefill"),
                      threads=0, eps=first.input_layernorm.eps, scale=first.scale)
        table = (Layer * len(layers))()
        for entry, layer in zip(table, layers):
            for name, m in zip(("qkv", "o", "gate_up", "down"), (getattr(layer, p) for p in PROJECTIONS)):
                setattr(entry, name, m.panels.data_ptr())
                setattr(entry, f"{name}_form", cpu_kernels.form_of(m.panels))
            entry.in_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        return cls(attention=attention, dtype=dtype, shape=shape, table=table)

    def bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.bound is not kv_caches:
            for entry, (k, v) in zip(self.table, kv_caches):
                entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
            self.bound = kv_caches

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, delta) after every layer, as the layers' loop gives them, or None where this step is not all the
        kernels' (the loop runs it)."""
        s, tokens = self.shape, x.shape[0]
        bf16 = self.dtype == torch.bfloat16
        if (bf16 and tokens > cpu_kernels.DIRECT_ROWS) or len(kv_caches) != len(self.table) or x.dtype != self.dtype:
            return None
        hd, kv = s.head_dim, s.kv_heads * s.head_dim
        qkv = x.new_empty((tokens, (s.heads + 2 * s.kv_heads) * hd))
        q = qkv[:, :s.heads * hd].view(tokens, s.heads, hd)
        k = qkv[:, s.heads * hd:s.heads * hd + kv].view(tokens, s.kv_heads, hd)
        v = qkv[:, s.heads * hd + kv:].view(tokens, s.kv_heads, hd)
        plan = self.attention.plan(meta, q, k, v, kv_caches[0][0])
        if not plan.all_kernel:
            return None
        rows = plan.kernel
        self.bind(kv_caches)
        s.threads = torch.get_num_threads()
        tables, decodes, prefills = rows.tables, rows.decode, rows.prefill
        delta, h = torch.empty_like(x), torch.empty_like(x)
        attn, act = x.new_empty((tokens, s.heads * hd)), x.new_empty((tokens, s.inter))
        gate_up = None if bf16 else x.new_empty((tokens, 2 * s.inter))
        step = Step(x=x.data_ptr(), delta=delta.data_ptr(), h=h.data_ptr(), qkv=qkv.data_ptr(), attn=attn.data_ptr(),
                    act=act.data_ptr(), gate_up=None if gate_up is None else gate_up.data_ptr(), cos=cos.data_ptr(),
                    sin=sin.data_ptr(), slots=meta.slot_mapping.data_ptr(),
                    tables=tables.data_ptr(), starts=rows.starts.data_ptr(), qlens=rows.qlens.data_ptr(),
                    lens=rows.lens.data_ptr(),
                    decodes=None if decodes is None else decodes.data_ptr(),
                    prefills=None if prefills is None else prefills.data_ptr(),
                    n_decodes=0 if decodes is None else len(decodes),
                    n_prefills=0 if prefills is None else len(prefills),
                    tokens=tokens, table_stride=tables.stride(0))
        if cpu_kernels.load().layer_stack(ctypes.addressof(s), ctypes.addressof(self.table), len(self.table),
                                          ctypes.addressof(step)) != 0:
            raise ValueError("a kernel of the layer stack refused the model's shapes")
        return x, delta
