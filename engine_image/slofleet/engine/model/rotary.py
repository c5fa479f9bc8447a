"""Rotary position embedding tables (cos/sin), across the rope types of the Llama family."""
from __future__ import annotations

import math

import torch


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
