"""Llama-family forward pass (Llama, Qwen2, Mistral, SmolLM) over the paged KV cache.

Written against the attention interface only; no transformers modeling code. Q/K/V and gate/up
projections are fused into one matrix each, so a step runs two large GEMMs where it would run five.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import cpu_kernels, quant
from .attention import AttentionBackend, AttentionMetadata
from .layer_stack import LayerStack

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def rope_settings(config) -> dict:
    """Rope parameters across transformers versions (`rope_parameters` in v5, `rope_theta`/`rope_scaling` before)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inv_frequencies(config, head_dim: int) -> torch.Tensor:
    p = rope_settings(config)
    # fp32 arithmetic exactly as the reference implementation, so angles agree bit for bit
    inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = p["rope_type"]
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / p["factor"]).float()
    if kind == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    raise ValueError(f"rope type {kind!r} is not supported (default, linear, llama3 are)")


class Rotary:
    """cos/sin tables, computed on the CPU even while the model is built on the meta device. Both halves of each
    row are stored (sin with the first half negated), so rotating is x * cos + roll(x) * sin, three ops in place
    of chunk/cat arithmetic, with the same roundings."""

    def __init__(self, config, head_dim: int, max_len: int):
        pos = torch.arange(max_len, dtype=torch.float32, device="cpu")
        freqs = torch.outer(pos, inv_frequencies(config, head_dim).to("cpu"))
        cos, sin = freqs.cos(), freqs.sin()
        self.cos, self.sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)

    def to(self, device: torch.device) -> Rotary:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for one step's positions, looked up once and shared by every layer."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate-half convention, as in the Hugging Face checkpoints: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s], in fp32.
    if cpu_kernels.rope_usable(x):
        return cpu_kernels.rope(x, cos, sin)  # in place
    xf = x.float()
    return xf.roll(xf.shape[-1] // 2, -1).mul_(sin).add_(xf * cos).to(x.dtype)


def swiglu(x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up projection of x: in the GEMM's last step where its tiles pair the two
    halves (CausalLM.pack), so the [rows, 2 x inter] product is never written; else the product, then silu_mul."""
    if gate_up.paired:
        return cpu_kernels.gemm(x, gate_up.panels, silu=True)
    return silu_mul(dense(x, gate_up))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused projection; the kernel, where it applies, rounds as torch's ops do."""
    if cpu_kernels.silu_usable(gate_up):
        return cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate).mul_(up)


# Rows up to which x @ W.T runs as W @ x.T on the CPU, where no kernel of ours holds the weight (CausalLM.pack). For
# the few rows of a decode step, MKL's sgemm runs W @ x.T about twice as fast as x @ W.T (it streams the weight once
# instead of re-reading it per row block) up to ~32 rows; oneDNN's bf16 kernels keep that lead up to 256 rows: at this
# model's shapes on an AMX Xeon (measured before the tile kernel took bf16 there), 30 layers took 16.3 ms against 24.9
# at 64 rows, 32.0 against 45.2 at 256, and lost at 512 (69.6 against 59.6).
TRANSPOSED_ROWS = {torch.float32: 32, torch.bfloat16: 256}


def dense(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x @ W.T (+ b): by the GEMM kernel where the layer holds its panels (CausalLM.pack; a contiguous result),
    else as W @ x.T for a decode step's few rows on the CPU (TRANSPOSED_ROWS), whose result is a column-major view:
    element-wise ops take it as it is, and a caller that hands it to a kernel or a view that needs a contiguous last
    dimension copies it (`.contiguous()`, free on the other paths)."""
    panels = getattr(layer, "panels", None)
    if panels is not None:
        y = cpu_kernels.gemm(x, panels)
        return y if layer.bias is None else y.add_(layer.bias)
    if x.shape[0] > TRANSPOSED_ROWS.get(x.dtype, 32) or x.device.type != "cpu":
        return nn.functional.linear(x, layer.weight, layer.bias)
    y = (layer.weight @ x.T).T
    return y if layer.bias is None else y + layer.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x) * weight, after adding delta to x in place (the residual add before it, fused on the CPU)."""
        if x.is_contiguous() and cpu_kernels.usable(x, self.weight):
            return cpu_kernels.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config, attention: AttentionBackend):
        super().__init__()
        h, self.n_heads, self.n_kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.n_heads
        qkv_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.qkv_proj = nn.Linear(h, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bool(getattr(config, "attention_bias", False)))
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=mlp_bias)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.attention = attention
        self.scale = self.head_dim ** -0.5

    def forward(self, x, delta, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        """x: the residual stream; delta: what the layer before adds to it (None for the first), added in the input
        norm. Returns the stream and this layer's own delta, in the same form."""
        hd, nq = self.head_dim, self.n_heads * self.head_dim
        qkv = dense(self.input_layernorm(x, delta), self.qkv_proj).contiguous()  # V goes to the KV-store kernel
        # q and k rotate together: one pass over both instead of two
        qk = rotate(qkv[:, :nq + self.n_kv * hd].unflatten(1, (self.n_heads + self.n_kv, hd)), cos, sin)
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        v = qkv[:, nq + self.n_kv * hd:].reshape(-1, self.n_kv, hd)
        o = self.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        h = self.post_attention_layernorm(x, dense(o.reshape(-1, nq), self.o_proj))
        return x, dense(swiglu(h, self.gate_up_proj), self.down_proj)


class CausalLM(nn.Module):
    def __init__(self, config, attention: AttentionBackend, max_len: int):
        super().__init__()
        arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, attention) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for m in self.modules():  # dense() asks each step; a missing attribute costs nn.Module's slow lookup
            if isinstance(m, nn.Linear):
                m.panels, m.paired = None, False
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config, self.layers[0].head_dim, max_len)
        self.stack: LayerStack | None = None  # pack() builds it where the CPU kernels take every layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits, contiguous and in the model's dtype (the sampler widens what it needs), for the rows in
        logits_indices only: prompt positions never reach the LM head."""
        x, delta = self.embed_tokens(input_ids), None
        cos, sin = self.rotary.at(positions)
        stacked = None if self.stack is None else self.stack.run(x, cos, sin, kv_caches, meta)
        if stacked is not None:
            x, delta = stacked
        else:
            for layer, (kc, vc) in zip(self.layers, kv_caches):
                x, delta = layer(x, delta, cos, sin, kc, vc, meta)
        return dense(self.norm(x[logits_indices], delta[logits_indices]), self.lm_head).contiguous()

    def forms(self) -> dict[int, quant.Form]:
        """The exact GGUF forms (quant.recover) of this model's fp32 projection weights, the LM head's included, by id
        of their layer: asked before the cast to bf16, which loses what tells them apart; pack() keeps them."""
        return {id(m): f for m in self.modules() if isinstance(m, nn.Linear) and (f := quant.recover(m.weight))}

    def pack(self, forms: dict[int, quant.Form] | None = None) -> None:
        """Where a CPU GEMM kernel takes a projection (fp32 on AVX-512 or AVX2, bf16 on AMX or AVX512-BF16), keep its
        weight only in the kernel's packed form (the first layout is freed, so no more memory), used at every step size;
        bf16 gate/up tiles are paired, so the MLP's activation runs in their GEMM (swiglu). A layer in `forms` keeps
        its quantised form where a kernel of its dtype unpacks it (cpu_kernels.unpacks). A tied LM head's packed form
        is a copy: the embedding keeps its weight for the lookups."""
        forms = forms or {}
        gate_ups = {id(layer.gate_up_proj) for layer in self.layers}
        for m in self.modules():
            paired = id(m) in gate_ups and m.bias is None  # a bias would have to be added before the activation
            panels = cpu_kernels.pack(m.weight, paired, forms.get(id(m))) if isinstance(m, nn.Linear) else None
            if panels is not None:
                m.panels, m.paired = panels, paired and cpu_kernels.form_dtype(panels) == torch.bfloat16
                if m.weight is not self.embed_tokens.weight:
                    m.weight = nn.Parameter(m.weight.new_empty(0, m.in_features), requires_grad=False)
        self.stack = LayerStack.build(self)

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill the fused parameters from Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...)."""
        own = dict(self.named_parameters())
        fused = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
        plain = {"o_proj": "self_attn.o_proj", "down_proj": "mlp.down_proj",
                 "input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}
        loaded: set[str] = set()

        def take(name: str) -> torch.Tensor:
            loaded.add(name)
            return tensors[name]

        with torch.no_grad():
            for name, param in own.items():
                if name == "lm_head.weight" and self.lm_head.weight is self.embed_tokens.weight:
                    continue
                if name.startswith("layers."):
                    _, idx, mod, kind = name.split(".")
                    prefix = f"model.layers.{idx}."
                    if mod in fused:
                        src = torch.cat([take(f"{prefix}{p}.{kind}") for p in fused[mod]], dim=0)
                    else:
                        src = take(f"{prefix}{plain[mod]}.{kind}")
                elif name == "lm_head.weight":
                    src = take("lm_head.weight") if "lm_head.weight" in tensors else take("model.embed_tokens.weight")
                else:
                    src = take(f"model.{name}")
                if src.shape != param.shape:
                    raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)}, model {tuple(param.shape)}")
                param.copy_(src)
        unused = [n for n in tensors if n not in loaded and "rotary_emb" not in n]
        if unused and not (unused == ["lm_head.weight"] and self.lm_head.weight is self.embed_tokens.weight):
            raise ValueError(f"checkpoint has weights the model does not use: {unused[:5]}")
