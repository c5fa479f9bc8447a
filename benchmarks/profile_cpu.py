"""Measure our engine on this machine and write the CPU replica profile the fleet simulator uses.

    .venv/bin/python benchmarks/profile_cpu.py [--out autoscaler/slofleet/autoscaler/data/cpu_profile.json]

It times every engine step with its composition (prompt tokens computed, decoding sequences, KV tokens
attended), fits  step_s = a + b*prefill_tokens + c*decode_seqs + d*kv_tokens  by least squares, then
replays a small Poisson load mix and stores its measured TTFT/TPOT P50, so a test can check the simulator
against the engine (the issue asks for P50s within 25%).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np

from slofleet.engine import EngineConfig, LLMEngine, SamplingParams

OUT = Path(__file__).resolve().parents[1] / "autoscaler/slofleet/autoscaler/data/cpu_profile.json"
BUDGET = 512  # max_num_batched_tokens: long prompts are prefilled in chunks of this size


def prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 10_000) for _ in range(n)]


def timed_steps(engine: LLMEngine, reqs: list, rows: list) -> None:
    """Run until `reqs` finish, appending (prefill_tokens, decode_seqs, kv_tokens, seconds) per step."""
    while engine.has_unfinished():
        before = {id(r): r.num_computed_tokens for r in reqs}
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        pre = dec = kv = 0
        for r in reqs:
            n = r.num_computed_tokens - before[id(r)]
            if n <= 0:
                continue
            kv += r.num_computed_tokens
            if before[id(r)] < r.num_prompt_tokens:
                pre += n
            else:
                dec += 1
        if pre or dec:
            rows.append((pre, dec, kv, dt))


def fit(engine: LLMEngine, rng: random.Random) -> tuple[list[float], float]:
    rows: list = []
    for n in (64, 256, 512, 1024):  # prefill-dominated steps (1024: two chunks)
        reqs = [engine.add_request(prompt(n, rng), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))]
        timed_steps(engine, reqs, rows)
        print(f"prefill {n}: {rows[-1]}", flush=True)
    for batch in (1, 8, 32):  # decode-dominated steps at two context lengths
        for n in (64, 384):
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            reqs = [engine.add_request(prompt(n, rng), params) for _ in range(batch)]
            timed_steps(engine, reqs, rows)
    print(f"fit: {len(rows)} steps timed", flush=True)
    x = np.array([(1.0, p, d, k) for p, d, k, _ in rows])
    y = np.array([t for *_, t in rows])
    # Relative error is what the simulator's TTFT/TPOT care about: weight each step by 1/time, or the few
    # long prefill steps decide the fit and the short decode steps (TPOT) come out far off.
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    coef = np.maximum(coef, 0.0)  # a negative cost is fit noise, not physics
    rel = np.abs(x @ coef - y) / y
    return [float(c) for c in coef], float(np.median(rel))


def load_mix(engine: LLMEngine, rng: random.Random, n: int, rate: float) -> dict:
    """Poisson arrivals at `rate`/s; returns the mix and the measured TTFT/TPOT P50."""
    t, mix = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        mix.append((round(t, 4), rng.randint(64, 512), rng.randint(8, 24)))
    start, pending, reqs = time.monotonic(), list(mix), []
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            _, p, o = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
            reqs.append(engine.add_request(prompt(p, rng), params))
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0][0] - now))
    ttft = [r.timings()["ttft_s"] for r in reqs]
    tpot = [r.timings()["decode_s"] / (len(r.output_token_ids) - 1) for r in reqs]
    return {"rate": rate, "arrivals": mix, "ttft_p50_s": statistics.median(ttft), "tpot_p50_s": statistics.median(tpot)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--rate", type=float, default=0.2, help="arrivals per second of the validation mix")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (one is steadier on a shared machine)")
    args = ap.parse_args()
    rng = random.Random(0)
    t0 = time.monotonic()
    engine = LLMEngine(EngineConfig(dtype="float32", max_num_batched_tokens=BUDGET, max_num_seqs=64,
                                    enable_prefix_caching=False,  # random prompts share nothing
                                    num_threads=args.threads))
    load_s = time.monotonic() - t0
    engine.add_request(prompt(64, rng), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():  # warm-up: first steps pay one-off allocation costs
        engine.step()
    (a, b, c, d), err = fit(engine, rng)
    profile = {
        "name": "cpu",
        "source": f"measured by benchmarks/profile_cpu.py: {engine.model_name}, float32, "
                  f"{engine.runner.device}, torch threads={engine.config.num_threads or 'quota'}, "
                  f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        # other work on the machine slows every step: the simulator check is only meaningful when this
        # stays below the CPU count
        "load_average": round(os.getloadavg()[0], 1), "cpus": os.cpu_count(),
        "step_s": a, "prefill_token_s": b, "decode_seq_s": c, "kv_token_s": d,
        "fit_median_rel_error": err,
        "token_budget": BUDGET, "max_batch": engine.config.max_num_seqs,
        "kv_tokens": engine.kv.pool.num_blocks * engine.config.block_size,
        # the measured model load plus a few seconds for a pod to be scheduled and its container to start
        "cold_start_s": round(load_s + 5.0, 1),
        "validation": load_mix(engine, rng, args.requests, args.rate),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    v = profile["validation"]
    print(f"step = {a*1e3:.2f} ms + {b*1e6:.1f} us/prefill token + {c*1e3:.3f} ms/seq + {d*1e6:.3f} us/KV token "
          f"(median fit error {err:.0%}); load mix TTFT P50 {v['ttft_p50_s']*1e3:.0f} ms, "
          f"TPOT P50 {v['tpot_p50_s']*1e3:.1f} ms -> {args.out}")


if __name__ == "__main__":
    main()
