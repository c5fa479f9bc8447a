"""Llama-family forward pass (Llama, Qwen2, Mistral, SmolLM) over the paged KV cache.

Written once against the backend's operations (backends/ops.py: linear, add + RMSNorm, rotary, SiLU-and-mul,
attention over a typed plan); no transformers modeling code, and no knowledge of which kernel runs. Q/K/V and gate/up
projections are fused into one matrix each, so a step runs two large GEMMs where it would run five.
"""
from __future__ import annotations

import torch
from torch import nn

from ..backends.ops import AttentionMetadata, LayerRun, Ops
from .rotary import Rotary

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class RMSNorm(nn.Module):
    """The norm's weight and eps; the backend's add_rms_norm applies them, after the residual add it fuses."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class DecoderLayer(nn.Module):
    def __init__(self, config, ops: Ops):
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
        self.ops = ops
        self.scale = self.head_dim ** -0.5

    def forward(self, x, delta, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        """x: the residual stream; delta: what the layer before adds to it (None for the first), added in the input
        norm. Returns the stream and this layer's own delta, in the same form."""
        ops, hd, nq = self.ops, self.head_dim, self.n_heads * self.head_dim
        norm, post = self.input_layernorm, self.post_attention_layernorm
        qkv = ops.linear(ops.add_rms_norm(x, delta, norm.weight, norm.eps), self.qkv_proj).contiguous()  # V: KV store
        # q and k rotate together: one pass over both instead of two
        qk = ops.rotate(qkv[:, :nq + self.n_kv * hd].unflatten(1, (self.n_heads + self.n_kv, hd)), cos, sin)
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        v = qkv[:, nq + self.n_kv * hd:].reshape(-1, self.n_kv, hd)
        o = ops.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        h = ops.add_rms_norm(x, ops.linear(o.reshape(-1, nq), self.o_proj), post.weight, post.eps)
        return x, ops.linear(ops.swiglu(h, self.gate_up_proj), self.down_proj)


class CausalLM(nn.Module):
    def __init__(self, config, ops: Ops, max_len: int):
        super().__init__()
        arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.config, self.ops = config, ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for m in self.modules():  # a backend's linear asks each step; a missing attribute costs nn.Module's slow lookup
            if isinstance(m, nn.Linear):
                m.panels, m.paired = None, False
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config, self.layers[0].head_dim, max_len)
        self.stack: LayerRun | None = None  # set by the backend's prepare() where it runs a step's layers in one go

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits, contiguous and in the model's dtype (the sampler widens what it needs), for the rows in
        logits_indices only: prompt positions never reach the LM head."""
        return self.ops.linear(self.hidden(input_ids, positions, kv_caches, meta, logits_indices), self.lm_head
                               ).contiguous()

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden state (after the final norm) at `rows` (None: every position), which the LM head reads and
        pooling (pooling.py) averages."""
        x, delta = self.embed_tokens(input_ids), None
        cos, sin = self.rotary.at(positions)
        stacked = None if self.stack is None else self.stack.run(x, cos, sin, kv_caches, meta)
        if stacked is not None:
            x, delta = stacked
        else:
            for layer, (kc, vc) in zip(self.layers, kv_caches):
                x, delta = layer(x, delta, cos, sin, kc, vc, meta)
        if rows is not None:
            x, delta = x[rows], delta[rows]
        return self.ops.add_rms_norm(x, delta, self.norm.weight, self.norm.eps)

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
