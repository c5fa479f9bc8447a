"""`--dtype auto` on the CPU: measure, don't guess. A CPU with avx512_bf16 but no AMX can run bf16 GEMMs slower than
fp32, one with AMX runs them several times faster, so a short probe times both at the model's own prefill and decode
shapes and picks the faster: each as the engine runs it (fp32 through the CPU's own GEMM kernel where it is built).
The answer is cached per CPU model and features, torch version, thread count and shape,
so later starts skip the probe.

One timing is easily wrong on a shared machine: the first GEMMs of a process are slow (thread pool, kernel selection),
and a descheduled thread stalls a multi-threaded GEMM for a whole time slice. So the probe warms up first, then takes
the best of ROUNDS short windows per dtype and shape, interleaved, so that contention hits both dtypes alike and what is
kept is what the CPU can do."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...loader import cache_root
from . import cpu_kernels
from .kernel_library import cpu_model

log = logging.getLogger("slofleet.engine.dtype")
PREFILL_ROWS, DECODE_ROWS = 512, 16
# A step mix to weigh the two shapes by: one prefill chunk per DECODES_PER_PREFILL decode steps.
DECODES_PER_PREFILL = 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CANDIDATES = ("float32", "bfloat16")
ROUNDS, WINDOW_S, WARM_UP_S = 5, 0.03, 0.2
CLEARLY = 4.0  # a dtype whose step takes this many times the fastest's is out after a round


@dataclass(slots=True, kw_only=True)
class DtypeChoice:
    dtype: str
    reason: str  # "flag", "gpu" or "probe"
    gflops: dict[str, dict[str, float]]  # dtype -> {"prefill": GFLOP/s, "decode": GFLOP/s}; empty unless probed


def gemm_gflops(rows: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.05, kernel: bool = False,
                min_reps: int = 3) -> float:
    """GFLOP/s of [rows, k] @ [k, n]: torch's mm, or with `kernel` the product the engine runs in this dtype (the
    CPU's own GEMM kernel where one takes it, see cpu_kernels.pack; else torch's)."""
    a, b = torch.randn(rows, k).to(dtype), torch.randn(k, n).to(dtype)
    panels = cpu_kernels.pack(b.T.contiguous()) if kernel else None
    mm = torch.mm if panels is None else (lambda x, _: cpu_kernels.gemm(x, panels))
    mm(a, b)  # warm-up: first calls pay for kernel selection
    reps, t0 = 0, time.perf_counter()
    while True:
        mm(a, b)
        reps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and reps >= min_reps:
            return 2 * rows * k * n * reps / elapsed / 1e9


def step_seconds(figures: dict[str, float], k: int, n: int) -> float:
    """Time of the weighted step mix at these rates (the decision rule)."""
    flop = 2 * k * n
    return (PREFILL_ROWS * flop / figures["prefill"] + DECODES_PER_PREFILL * DECODE_ROWS * flop / figures["decode"])


def probe(hidden: int, intermediate: int) -> dict[str, dict[str, float]]:
    """Best GFLOP/s per dtype and shape over ROUNDS. A dtype CLEARLY slower than another after a round is measured
    no more: bf16 emulated on an AVX2 CPU is so slow that timing it every round would lengthen every start."""
    shapes = {"prefill": PREFILL_ROWS, "decode": DECODE_ROWS}
    for name in CANDIDATES:
        gemm_gflops(PREFILL_ROWS, hidden, intermediate, DTYPES[name], WARM_UP_S / len(CANDIDATES), kernel=True,
                    min_reps=1)
    best = {name: dict.fromkeys(shapes, 0.0) for name in CANDIDATES}
    measured = list(CANDIDATES)
    for _ in range(ROUNDS):
        for name in measured:
            for shape, rows in shapes.items():
                rate = gemm_gflops(rows, hidden, intermediate, DTYPES[name], WINDOW_S, kernel=True)
                best[name][shape] = max(best[name][shape], rate)
        seconds = {name: step_seconds(best[name], hidden, intermediate) for name in measured}
        measured = [name for name in measured if seconds[name] < CLEARLY * min(seconds.values())]
    return best


def cache_file() -> Path:
    return cache_root() / "dtype-probe.json"


def choose(name: str, device: torch.device, hidden: int, intermediate: int) -> DtypeChoice:
    if name != "auto":
        return DtypeChoice(dtype=name, reason="flag", gflops={})
    if device.type == "cuda":
        return DtypeChoice(dtype="bfloat16", reason="gpu", gflops={})
    # a probe of torch's GEMM answers nothing about the kernels the engine runs instead
    fp32, bf16 = cpu_kernels.panel_columns(), cpu_kernels.bf16_gemm()
    gemm = "+".join(k for k, on in (("fp32 kernel", fp32), (f"bf16 {bf16}", bf16)) if on) or "torch"
    key = f"{cpu_model()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{hidden}x{intermediate}|{gemm}"
    path = cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return DtypeChoice(**cached[key])
    figures = probe(hidden, intermediate)
    best = min(figures, key=lambda d: step_seconds(figures[d], hidden, intermediate))
    choice = DtypeChoice(dtype=best, reason="probe", gflops=figures)
    log.info("dtype probe (%s): %s -> %s", key, json.dumps(figures), best)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cached, key: asdict(choice)}, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only cache only costs the probe again next start
        log.warning("dtype probe not cached: %s", e)
    return choice
