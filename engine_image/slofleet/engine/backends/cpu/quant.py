"""The quantised forms that weights dequantised from a GGUF checkpoint still have, found back losslessly.

The embedded model ships as GGUF: its projections in Q4_1 (every 32 weights of a row are w = d * q + m, q in 0..15)
and its embedding, tied to the LM head, in Q8_0 (w = d * q, q in -127..127), each with fp16 d and m and computed in
fp32 as gguf dequantises it. Loading turns them into 16 or 32 bits a weight, which a decode step then streams from
memory in full. `recover` finds q, d and m again from the fp32 weights and keeps them only where they give back every
weight bit for bit, so the GEMM kernel that unpacks them (forms.h) computes on exactly the bf16 weights it would have
read: the same tokens, from 5 or 8.5 bits a weight instead of 16. Weights of any other origin fail the check on their
first rows and keep their dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per (d, m): a GGUF block along a row
SAMPLE_ROWS = 64  # rows tried first: a weight of another origin fails on them, before the whole is worked through
NEIGHBOURS = (-1, 1, -2, 2)  # fp16 steps from Q4_1's estimated d tried where it misses
KINDS = ("q4_1", "q8_0")  # forms.h's Form order, after PLAIN
STEP_BYTES = {"q4_1": 320, "q8_0": 544}  # forms.h's step_bytes: one panel's k-step of 32


@dataclass(slots=True, kw_only=True)
class Form:
    kind: str  # one of KINDS
    q: torch.Tensor  # [N, K] uint8 (q4_1) or int8 (q8_0)
    d: torch.Tensor  # [N, K / BLOCK] float16
    m: torch.Tensor | None  # [N, K / BLOCK] float16 (q4_1), None (q8_0)


def exact(w: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Per block [..., K / BLOCK]: whether d * q (+ m), in fp32 as gguf computes it, is w in every bit."""
    got = q * d.float()[..., None]  # in place from here: a weight's temporaries cost as much as the passes
    if m is not None:
        got.add_(m.float()[..., None])
    return got.eq_(w).all(-1)


def quantise(blocks: torch.Tensor, lo: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Each weight's q (as float) on the grid lo + d * q; 0 where d is 0."""
    df = d.float()[..., None]
    return (blocks - lo[..., None]).div_(df).round_().masked_fill_(df == 0, 0.0)


def fit_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q (float), d, m for blocks [..., BLOCK] that give back every one exactly, or None. q = 0 sits at a block's
    minimum (the quantiser put it there), so m is that minimum; d is the fp16 value nearest (max - min) / 15, or
    where that misses one of its NEIGHBOURS."""
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    m = lo.half()
    if not torch.equal(m.float(), lo):
        return None
    d = ((hi - lo) / 15).half()
    q = quantise(blocks, lo, d).clamp_(0, 15)
    ok = exact(blocks, q, d, m)
    for step in NEIGHBOURS:
        if ok.all():
            break
        idx = (~ok).nonzero(as_tuple=True)
        dt = (d[idx].view(torch.int16) + step).view(torch.float16)
        qt = quantise(blocks[idx], lo[idx], dt).clamp_(0, 15)
        good = exact(blocks[idx], qt, dt, m[idx])
        hit = tuple(i[good] for i in idx)
        q[hit], d[hit], ok[hit] = qt[good], dt[good], True
    return (q, d, m) if ok.all() else None


def fit_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None] | None:
    """q (float), d for blocks [..., BLOCK] that give back every one exactly, or None: the quantiser maps a block's
    largest magnitude to q = +-127, so d is that over 127, an fp16 value."""
    d32 = blocks.abs().amax(-1) / 127
    d = d32.half()
    if not torch.equal(d.float(), d32):
        return None
    q = quantise(blocks, torch.zeros_like(d32), d)
    return (q, d, None) if exact(blocks, q, d, None).all() else None


def recover(weight: torch.Tensor) -> Form | None:
    """The GGUF form (Q4_1, else Q8_0) of an fp32 weight [N, K] that gives back every element exactly, or None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.shape[0] == 0:
        return None
    w = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    for kind, fit in (("q4_1", fit_q4_1), ("q8_0", fit_q8_0)):
        if fit(w[:SAMPLE_ROWS]) is not None and (found := fit(w)) is not None:
            q, d, m = found
            return Form(kind=kind, q=q.to(torch.uint8 if m is not None else torch.int8).reshape(weight.shape), d=d, m=m)
    return None


def layout(form: Form, rows: torch.Tensor) -> torch.Tensor:
    """The kernel's bytes [N / 16, K / 32, STEP_BYTES] (forms.h) with panel p holding W's rows rows[16p:16p + 16]:
    per step, 16 tile rows of q (byte i of row kk: column i / 2 at k = 2 kk + i % 2, the second 8 columns in the
    high nibbles for q4_1, in the next 16 bytes for q8_0), then the 16 columns' d (and m) in fp16."""
    n, k = form.q.shape
    p, s = n // 16, k // BLOCK
    q = form.q[rows].view(torch.uint8).view(p, 16, s, 16, 2)  # [panel, column, step, kk, e]
    first, second = (q[:, h * 8:(h + 1) * 8].permute(0, 2, 3, 1, 4).reshape(p, s, 16, 16) for h in (0, 1))
    packed = first | (second << 4) if form.kind == "q4_1" else torch.cat([first, second], dim=-1)
    scales = [t[rows].view(p, 16, s).transpose(1, 2).contiguous().view(torch.uint8)
              for t in (form.d, form.m) if t is not None]
    return torch.cat([packed.reshape(p, s, -1), *scales], dim=-1).contiguous()
