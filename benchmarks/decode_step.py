"""Time the engine's decode step with the layer stack (engine/backends/cpu/layer_stack.py) and with the model's layer
loop, side by side in one run, at a few batch sizes.

    .venv/bin/python benchmarks/decode_step.py [--batches 16 32 64] [--steps 24]

Each batch's sequences are prefilled first (prompts of --prompt tokens); then decode steps alternate between the
two paths, so both see the same machine and the same KV lengths (a pair's steps are one token apart). Prints the
median step time and the per-sequence cost (step / batch) of each path and their ratio. Greedy tokens are the same
on both paths (tests/kernels/test_layer_stack.py), so alternating changes nothing the steps compute.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from slofleet.engine import LLMEngine, SamplingParams


def timed_decode(engine: LLMEngine, batch: int, prompt: int, steps: int, rng: random.Random) -> dict[str, list]:
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 2, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 10_000) for _ in range(prompt)], params)
    model = engine.runner.model
    stack, times = model.stack, {"stack": [], "loop": []}
    engine.step()
    while engine.last_step.num_tokens != batch:  # until every prompt is in the cache
        engine.step()
    for i in range(2 * steps):
        name = ("stack", "loop")[i % 2]
        model.stack = stack if name == "stack" else None
        t0 = time.perf_counter()
        engine.step()
        times[name].append(time.perf_counter() - t0)
    model.stack = stack
    while engine.has_unfinished():
        engine.step()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens a sequence")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed a path and batch")
    args = ap.parse_args()
    engine = LLMEngine(max_num_seqs=max(args.batches))
    if engine.runner.model.stack is None:
        print("the layer stack does not take this model here (it needs its weights in a GEMM kernel's form)")
        return 1
    rng = random.Random(0)
    print(f"{'batch':>5} {'stack ms':>9} {'loop ms':>8} {'stack ms/seq':>13} {'loop ms/seq':>12} {'loop/stack':>10}")
    for batch in args.batches:
        t = {k: statistics.median(v) * 1e3 for k, v in timed_decode(engine, batch, args.prompt, args.steps,
                                                                     rng).items()}
        print(f"{batch:>5} {t['stack']:>9.2f} {t['loop']:>8.2f} {t['stack'] / batch:>13.3f} {t['loop'] / batch:>12.3f} "
              f"{t['loop'] / t['stack']:>10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
