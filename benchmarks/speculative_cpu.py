"""Speculative decoding (n-gram drafts) on and off by batch size: mean TPOT per request and tokens/s, same rounds.

Two engines with the defaults, one with --num-speculative-tokens K, get the same batches of engine_cpu.py's prompts
(fresh ones every run): its summarising workload and its quoting one (each prompt asks for its notes back word for
word), 1, 4 and 16 requests at a time, greedy, a fixed number of output tokens. The first round is a warm-up.

    .venv/bin/python benchmarks/speculative_cpu.py [--rounds 4] [--tokens 64] [-k 4] [--batches 1 4 16]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine_cpu  # noqa: E402 (its workload, from beside this file)

from slofleet.engine import LLMEngine, SamplingParams  # noqa: E402


def run(engine: LLMEngine, ids: list[list[int]], tokens: int) -> tuple[float, float]:
    """(mean TPOT over the batch's requests, output tokens/s of the batch)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    reqs = [engine.add_request(x, params) for x in ids]
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    return statistics.mean(r.timings()["decode_s"] / (tokens - 1) for r in reqs), len(ids) * tokens / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=4, help="draft tokens a step")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    engines = {k: LLMEngine(num_speculative_tokens=k) for k in (0, args.k)}
    seeds = itertools.count(5000)
    got: dict[tuple, list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        for batch, quote, k in itertools.product(args.batches, (False, True), engines):
            texts = engine_cpu.prompts(next(seeds), quote=quote)[:batch]
            result = run(engines[k], engine_cpu.chat_ids(engines[k].tokenizer, texts), args.tokens)
            if rnd:
                got.setdefault((batch, quote, k), []).append(result)
    print(f"dtype {str(engines[0].runner.dtype).removeprefix('torch.')}, {args.tokens} output tokens, K={args.k}, "
          f"median of {args.rounds - 1} rounds")
    for batch, quote in itertools.product(args.batches, (False, True)):
        (t0, r0), (t1, r1) = ([statistics.median(x[i] for x in got[(batch, quote, k)]) for i in (0, 1)]
                              for k in engines)
        print(f"batch {batch:2d} {'quote' if quote else 'default':7s}: TPOT {t0 * 1000:5.1f} -> {t1 * 1000:5.1f} ms "
              f"({t0 / t1:.2f}x), tok/s {r0:6.1f} -> {r1:6.1f} ({r1 / r0:.2f}x)")
    spec = engines[args.k].stats().spec
    print(f"draft tokens accepted: {sum(spec.accepted.values())} of {sum(spec.drafted.values())} "
          f"in {sum(spec.drafts.values())} drafts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
