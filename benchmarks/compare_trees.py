"""Compare two checkouts of slofleet on this machine: the same bits, and the same speed.

    .venv/bin/python benchmarks/compare_trees.py bits --old /work/main
    .venv/bin/python benchmarks/compare_trees.py speed --old /work/main [--rounds 3]

`bits` runs one greedy workload (short and long prompts, chunked prefill, n-gram drafts, top-5 log-probabilities)
through LLM() in fp32 and bf16 under each tree's own Python, and compares every token and every log-probability
bit for bit (as float.hex). bf16 runs where this CPU has a bf16 GEMM kernel (else the fp32 comparison only).

`speed` runs benchmarks/engine_cpu.py (the slofleet rows only) and benchmarks/decode_step.py under each tree in
turn, old then new then old ..., --rounds times each, and prints each figure's median per tree and the ratio
new / old. The trees alternate so that the machine's drift moves both alike. Each tree runs its own copy of the
benchmark, so a tree is measured as it stands.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

NEW = Path(__file__).resolve().parents[1]

BITS = r"""
import json, sys
from slofleet.engine import LLM, SamplingParams
try:
    from slofleet.engine.backends.cpu import cpu_kernels
except ImportError:  # a tree from before the backends' move
    from slofleet.engine import cpu_kernels

prompts = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):",
           "Once upon a time " * 60, "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4,",
           "Summarise: the quick brown fox jumps over the lazy dog. " * 12]
params = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)
dtype, name = sys.argv[1], sys.argv[2]
extra = {"plain": {}, "chunked": {"max_num_batched_tokens": 64},
         "drafts": {"num_speculative_tokens": 3, "speculative_ngram": 2}}[name]
out = None
if dtype == "float32" or cpu_kernels.bf16_gemm():
    got = LLM(dtype=dtype, max_num_seqs=8, **extra).generate(prompts, params)
    out = [[o.token_ids, [{str(t): v.hex() for t, v in lp.items()} for lp in o.logprobs]] for o in got]
json.dump(out, sys.stdout)
"""


def python_of(tree: Path) -> str:
    return str(tree / ".venv" / "bin" / "python")


def run_in(tree: Path, args: list[str], stdin: str | None = None) -> str:
    """stdout of the tree's Python running args in the tree (its own slofleet, its own benchmarks)."""
    done = subprocess.run([python_of(tree), *args], cwd=tree, input=stdin, capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


CONFIGS = [(dtype, name) for dtype in ("float32", "bfloat16") for name in ("plain", "chunked", "drafts")]


def bits(old: Path, only: list[str]) -> int:
    """Each configuration in a fresh process of each tree, so no engine inherits another's state. fp32 chunked
    prefill's logprobs vary from run to run in either tree (docs/kernels-notes.md)."""
    bad = 0
    for dtype, name in CONFIGS:
        if only and name not in only:
            continue
        a, b = (json.loads(run_in(tree, ["-", dtype, name], BITS)) for tree in (old, NEW))
        if a is None and b is None:
            print(f"{dtype} {name}: no bf16 GEMM kernel on this CPU, not compared")
            continue
        key, same = f"{dtype} {name}", a == b
        tokens = sum(len(t) for t, _ in a)
        print(f"{key:18s} {tokens:4d} tokens, {tokens * 5:5d} log-probabilities: {'identical' if same else 'DIFFER'}")
        bad += not same
    return 1 if bad else 0


# engine_cpu.py's table rows and decode_step.py's rows: (label, figure)
ENGINE_ROW = re.compile(r"^(slofleet LLM\(dtype=\w+\))\s+([\d.]+)", re.M)
DECODE_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)", re.M)


def figures(tree: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    engine = run_in(tree, ["benchmarks/engine_cpu.py", "--runs", "1", "--skip", "generate", "generate_batch",
                           "defaults", "llama.cpp"])
    for name, rate in ENGINE_ROW.findall(engine):
        out[f"engine_cpu {name} tok/s"] = float(rate)
    decode = run_in(tree, ["benchmarks/decode_step.py", "--batches", "16", "64", "--steps", "16"])
    for batch, stack, loop in DECODE_ROW.findall(decode):
        out[f"decode_step batch {batch} stack ms"] = float(stack)
        out[f"decode_step batch {batch} loop ms"] = float(loop)
    return out


def speed(old: Path, rounds: int) -> int:
    runs: dict[Path, list[dict[str, float]]] = {old: [], NEW: []}
    for i in range(rounds):
        for tree in (old, NEW) if i % 2 == 0 else (NEW, old):
            runs[tree].append(figures(tree))
            print(f"round {i + 1} {tree}: {json.dumps(runs[tree][-1])}", file=sys.stderr, flush=True)
    print(f"{'figure':48s} {'old':>9s} {'new':>9s} {'new/old':>8s}")
    for key in runs[old][0]:
        o = statistics.median(r[key] for r in runs[old])
        n = statistics.median(r[key] for r in runs[NEW] if key in r)
        print(f"{key:48s} {o:9.2f} {n:9.2f} {n / o:8.3f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["bits", "speed"])
    ap.add_argument("--old", type=Path, required=True, help="the other checkout (with its own .venv)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=[], help="bits: these configurations only (plain, chunked, drafts)")
    args = ap.parse_args()
    return bits(args.old.resolve(), args.only) if args.what == "bits" else speed(args.old.resolve(), args.rounds)


if __name__ == "__main__":
    sys.exit(main())
