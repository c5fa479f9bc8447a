"""The CPU attention kernels of two builds side by side: the working tree's and a git revision's (--base), called
alternately on the same inputs in one process, since on a shared 2-core VM the same build's figures moved 10-20%
from one process to the next while such pairs kept their order.

- decode: paged_decode over --layers layers of caches in --dtype, --rows rows of --ctx tokens (+-half, so the threads'
  shares differ), their blocks in random order in a pool the size of the engine's default (1 GiB for the embedded
  model's shapes); "memory" walks every layer's cache once, "cache" one layer's --layers times.
- prefill: the engine's prefill kernel (tile_prefill on AMX, else paged_prefill) over 2,048 prompt tokens of 50-420
  token prompts, behind a 30-token cached prefix but the first's.

Each build's median ms, the ratio and the largest output difference between the builds are printed.

--dtype is the caches' and queries' (default: bfloat16 where the CPU has bf16 kernels, else float32, as LLM() picks
on such CPUs).

    .venv/bin/python benchmarks/attention_cpu.py [--base HEAD~1] [--ctx 240] [--rows 16] [--layers 30] [--dtype float32]
"""
from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from slofleet.engine.backends.cpu import cpu_kernels, dtype_probe

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16  # the embedded model's attention
POOL_BLOCKS = 2912  # its 1 GiB pool


def library(base: str | None, tmp: Path) -> ctypes.CDLL:
    """The working tree's kernels (base None), or those of git revision base, built in tmp."""
    if base is None:
        return cpu_kernels.load()
    src = tmp / "src"
    src.mkdir()
    root = cpu_kernels.HERE
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True,
                         check=True).stdout.strip()
    for f in cpu_kernels.SOURCES + cpu_kernels.HEADERS:
        for rel in (f.relative_to(top), Path("engine_image/slofleet/engine") / f.name):  # before the backends' move
            shown = subprocess.run(["git", "show", f"{base}:{rel}"], cwd=top, capture_output=True)
            if shown.returncode == 0:
                break
        if shown.returncode == 0:  # a file the revision did not have yet is left out
            (src / f.name).write_bytes(shown.stdout)
    out = tmp / "base.so"
    cpu_kernels.build(out, sources=sorted(p for p in src.iterdir() if p.suffix == ".cpp"))
    lib = ctypes.CDLL(str(out))
    for name in ("paged_decode", "paged_prefill", "tile_prefill"):
        getattr(lib, name).argtypes = cpu_kernels.SIGNATURES[name]
    lib.tile_enable()
    return lib


def alternate(calls: dict[str, object], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def decode_case(libs: dict[str, ctypes.CDLL], args) -> None:
    rng = random.Random(0)
    per = -(-(2 * args.ctx) // BLOCK)
    blocks = list(range(POOL_BLOCKS))
    rng.shuffle(blocks)
    tables = torch.tensor([blocks[i * per:(i + 1) * per] for i in range(args.rows)], dtype=torch.int32)
    lens = torch.tensor([args.ctx + rng.randrange(-args.ctx // 2, args.ctx // 2) for _ in range(args.rows)],
                        dtype=torch.int32)
    caches = [(torch.randn(POOL_BLOCKS, BLOCK, KV_HEADS, DIM, dtype=args.dtype),
               torch.randn(POOL_BLOCKS, BLOCK, KV_HEADS, DIM, dtype=args.dtype)) for _ in range(args.layers)]
    q = torch.randn(args.rows, HEADS, DIM, dtype=args.dtype)
    outs = {name: torch.empty_like(q) for name in libs}
    rows = torch.arange(args.rows, dtype=torch.int32)
    ones = torch.ones(args.rows, dtype=torch.int32)

    def run(name: str, hot: bool):
        def call():
            for i in range(args.layers):
                k, v = caches[0 if hot else i]
                libs[name].paged_decode(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
                                        tables.data_ptr(), tables.stride(0), rows.data_ptr(), args.rows,
                                        rows.data_ptr(), ones.data_ptr(), lens.data_ptr(), outs[name].data_ptr(),
                                        HEADS, KV_HEADS, DIM, BLOCK, DIM ** -0.5, cpu_kernels.DTYPES[args.dtype],
                                        torch.get_num_threads())
        return call
    for hot in (False, True):
        report(f"decode {args.rows} x {args.ctx} ({'cache' if hot else 'memory'}, {args.dtype_name})",
               alternate({name: run(name, hot) for name in libs}, args.rounds), outs)


def prefill_case(libs: dict[str, ctypes.CDLL], args) -> None:
    rng = random.Random(1)
    lens: list[int] = []
    while sum(lens) < 2048:
        lens.append(min(rng.randrange(50, 420), 2048 - sum(lens)))
    ctx = [0] + [30] * (len(lens) - 1)
    per = max(-(-(c + n) // BLOCK) for c, n in zip(ctx, lens))
    tables = torch.arange(len(lens) * per, dtype=torch.int32).view(len(lens), per)
    layers = min(args.layers, 6)
    caches = [(torch.randn(len(lens) * per, BLOCK, KV_HEADS, DIM, dtype=args.dtype),
               torch.randn(len(lens) * per, BLOCK, KV_HEADS, DIM, dtype=args.dtype)) for _ in range(layers)]
    q = torch.randn(2048, HEADS, DIM, dtype=args.dtype)
    outs = {name: torch.empty_like(q) for name in libs}
    rows = torch.arange(len(lens), dtype=torch.int32)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int32)
    qlens = torch.tensor(lens, dtype=torch.int32)
    seqs = torch.tensor([c + n for c, n in zip(ctx, lens)], dtype=torch.int32)
    kind = cpu_kernels.prefill_kernel(args.dtype, HEADS, KV_HEADS, DIM)

    def run(name: str):
        def call():
            for k, v in caches:
                getattr(libs[name], kind)(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
                                          tables.data_ptr(), tables.stride(0), rows.data_ptr(), len(lens),
                                          starts.data_ptr(), qlens.data_ptr(), seqs.data_ptr(),
                                          outs[name].data_ptr(), HEADS, KV_HEADS, DIM, BLOCK, DIM ** -0.5,
                                          cpu_kernels.DTYPES[args.dtype], torch.get_num_threads())
        return call
    report(f"prefill 2048 ({kind}, {layers} layers, {args.dtype_name})",
           alternate({name: run(name) for name in libs}, args.rounds),
           outs)


def report(case: str, ms: dict[str, float], outs: dict[str, torch.Tensor]) -> None:
    (a, ta), (b, tb) = ms.items()
    diff = (outs[a].float() - outs[b].float()).abs().max().item()
    print(f"{case:40s} {a} {ta:7.2f} ms  {b} {tb:7.2f} ms  {a}/{b} {ta / tb:5.2f}  max |diff| {diff:.4f}",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD~1", help="git revision to compare the working tree with")
    ap.add_argument("--ctx", type=int, default=240)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    if cpu_kernels.load() is None:
        print("no CPU kernels on this machine (see the log for why)")
        return 1
    args.dtype_name = args.dtype or ("bfloat16" if cpu_kernels.bf16_kernels() else "float32")
    args.dtype = dtype_probe.DTYPES[args.dtype_name]
    with tempfile.TemporaryDirectory() as tmp:
        libs = {args.base: library(args.base, Path(tmp)), "tree": library(None, Path(tmp))}
        torch.manual_seed(0)
        decode_case(libs, args)
        prefill_case(libs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
