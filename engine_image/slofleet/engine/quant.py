"""The 4-bit form that weights dequantised from a Q4_1 checkpoint still have, found back losslessly.

The embedded model ships as GGUF Q4_1: every 32 weights of a row are w = d * q + m, in fp32, with q in 0..15 and
fp16 d and m (as gguf dequantises it). Loading turns them into 16 or 32 bits a weight, which a decode step then
streams from memory in full. `recover` finds q, d and m again from the fp32 weights and keeps them only where they
give back every weight bit for bit, so the GEMM kernel that unpacks them (tile_gemm.cpp) computes on exactly the bf16
weights it would have read: the same tokens, from 5 bits a weight instead of 16. Weights of any other origin fail the
check on their first rows and keep their dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per (d, m): Q4_1's block along a row
SAMPLE_ROWS = 64  # rows tried first: a weight that is not Q4_1 fails on them, before the whole is worked through
NEIGHBOURS = (-1, 1, -2, 2)  # fp16 steps from the estimated d tried where it misses


@dataclass(slots=True, kw_only=True)
class Q4:
    q: torch.Tensor  # [N, K] uint8, 0..15
    d: torch.Tensor  # [N, K / BLOCK] float16
    m: torch.Tensor  # [N, K / BLOCK] float16


def exact(w: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Per block [..., K / BLOCK]: whether (d * q) + m, in fp32 as gguf computes it, is w in every bit."""
    return (d.float()[..., None] * q + m.float()[..., None] == w).all(-1)


def quantise(blocks: torch.Tensor, lo: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Each weight's q (as float) on the grid m + d * q from the block's minimum lo; 0 where d is 0."""
    df = d.float()[..., None]
    return torch.where(df > 0, ((blocks - lo[..., None]) / df).round(), 0.0).clamp_(0, 15)


def fit(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q (float), d, m for blocks [..., BLOCK] of fp32 weights and which blocks they give back exactly; None where
    some block's minimum is no fp16 value (q = 0 sits at the minimum: the quantiser put it there). d is the fp16
    value nearest (max - min) / 15, or where that misses one of its NEIGHBOURS."""
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    m = lo.half()
    if not torch.equal(m.float(), lo):
        return None
    d = ((hi - lo) / 15).half()
    q = quantise(blocks, lo, d)
    ok = exact(blocks, q, d, m)
    for step in NEIGHBOURS:
        if ok.all():
            break
        idx = (~ok).nonzero(as_tuple=True)
        dt = (d[idx].view(torch.int16) + step).view(torch.float16)
        qt = quantise(blocks[idx], lo[idx], dt)
        good = exact(blocks[idx], qt, dt, m[idx])
        hit = tuple(i[good] for i in idx)
        q[hit], d[hit], ok[hit] = qt[good], dt[good], True
    return q, d, m, ok


def recover(weight: torch.Tensor) -> Q4 | None:
    """The Q4_1 form of an fp32 weight [N, K] that gives back every element exactly, or None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.shape[0] == 0:
        return None
    w = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    sample = fit(w[:SAMPLE_ROWS])
    if sample is None or not sample[3].all():
        return None
    found = fit(w)
    if found is None or not found[3].all():
        return None
    q, d, m, _ = found
    return Q4(q=q.to(torch.uint8).reshape(weight.shape), d=d, m=m)


def layout(form: Q4, rows: torch.Tensor) -> torch.Tensor:
    """The kernel's bytes [N / 16, K / 32, 320] (tile_gemm.cpp's Q4 step) with panel p holding W's rows
    rows[16p:16p + 16]: per step, 16 rows of 16 bytes (byte i of row kk: q of column i / 2 at k = 2 kk + i % 2 in its
    low nibble, of column 8 + i / 2 in its high one), then the 16 columns' d and m in fp16."""
    n, k = form.q.shape
    p, s = n // 16, k // BLOCK
    q = form.q[rows].view(p, 16, s, 16, 2)  # [panel, column, step, kk, e]
    lo, hi = (q[:, h * 8:(h + 1) * 8].permute(0, 2, 3, 1, 4).reshape(p, s, 16, 16) for h in (0, 1))
    nibbles = (lo | (hi << 4)).reshape(p, s, 256)
    scales = [t[rows].view(p, 16, s).transpose(1, 2).contiguous().view(torch.uint8) for t in (form.d, form.m)]
    return torch.cat([nibbles, *scales], dim=-1).contiguous()
