"""Goodput past the knee through the router, with SLO-predicted admission and without (mode off).

One `slofleet serve` (its bucket priorities and TPOT targets set to the mix's) behind `slofleet router` with the
issue's mix: chat (priority 0, TTFT 500 ms / TPOT 50 ms), long documents (~300 uncached tokens, priority 5,
1,500 / 100 ms), long outputs (priority 0, 500 / 50 ms). Poisson arrivals at each rate for `--duration` seconds,
with fresh prompts at every rate (its own seed). A request is within SLO when it was admitted and met both its
TTFT and TPOT targets; a refusal (429) counts as not within. Goodput = offered rate x share within SLO.

    .venv/bin/python benchmarks/admission_goodput.py --rates 0.5,1,2,3,6 --duration 45
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from router_prefix import MODEL, start, wait_ready  # noqa: E402

from slofleet.bench.loadgen import Bucket, Result, percentile, stream_one  # noqa: E402

MIX = [Bucket("chat", (20, 60), 24, ttft_slo=0.5, tpot_slo=0.05, share=0.6),
       Bucket("doc", (280, 320), 8, ttft_slo=1.5, tpot_slo=0.1, share=0.25),
       Bucket("long-output", (20, 40), 64, ttft_slo=0.5, tpot_slo=0.05, share=0.15)]
PRIORITY = {"chat": 0, "doc": 5, "long-output": 0}


def buckets(mode: str) -> dict:
    return {"buckets": [{"name": b.name, "priority": PRIORITY[b.name], "match": {"header": {"x-mix": b.name}},
                         "slo": {"ttftMs": round(b.ttft_slo * 1000), "tpotMs": round(b.tpot_slo * 1000)},
                         "admission": {"mode": mode}} for b in MIX]}


async def drive(router: str, rate: float, duration: float, seed: int) -> list[Result]:
    rng, tasks, t_end = random.Random(seed), [], time.monotonic() + duration
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)) as c:
        while time.monotonic() < t_end:
            b = rng.choices(MIX, weights=[b.share for b in MIX])[0]
            tasks.append(asyncio.create_task(timed(c, router, b, rng)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


async def timed(c: httpx.AsyncClient, router: str, b: Bucket, rng: random.Random) -> Result:
    """One request; a refused one's e2e is the time to its refusal."""
    t0 = time.perf_counter()
    r = await stream_one(c, router, b.body(MODEL, rng), b.name, send_bucket=False, headers={"x-mix": b.name})
    if r.status == 429:
        r.e2e = time.perf_counter() - t0
    return r


@dataclass
class Row:
    mode: str
    rate: float
    offered: int
    refused: int
    failed: int
    within: dict[str, tuple[int, int]]  # bucket -> (within SLO, offered)
    p0_admitted_within: float
    refusal_p99_ms: float

    @property
    def goodput(self) -> float:
        return self.rate * sum(w for w, _ in self.within.values()) / max(1, self.offered)


def judge(mode: str, rate: float, results: list[Result]) -> Row:
    slo = {b.name: b for b in MIX}
    ok = lambda r: r.status == 200 and not r.error and r.ttft <= slo[r.bucket].ttft_slo and (  # noqa: E731
        r.tpot or 0) <= slo[r.bucket].tpot_slo
    within = {b.name: (sum(ok(r) for r in results if r.bucket == b.name),
                       sum(r.bucket == b.name for r in results)) for b in MIX}
    p0 = [r for r in results if PRIORITY[r.bucket] == 0 and r.status == 200]
    return Row(mode, rate, len(results), sum(r.status == 429 for r in results),
               sum(r.status != 429 and (r.status != 200 or bool(r.error)) for r in results), within,
               sum(map(ok, p0)) / max(1, len(p0)),
               percentile([r.e2e * 1000 for r in results if r.status == 429], 99) if any(
                   r.status == 429 for r in results) else 0.0)


def run(mode: str, rates: list[float], args: argparse.Namespace, logs: Path, engine: str) -> list[Row]:
    (logs / f"{mode}.json").write_text(json.dumps(buckets(mode)))
    proc, router = start(["router", "--upstream", engine, "--buckets", str(logs / f"{mode}.json")],
                         logs / f"router-{mode}.log")
    rows = []
    try:
        asyncio.run(wait_ready(router))
        for i, rate in enumerate(rates):
            results = asyncio.run(drive(router, rate, args.duration, seed=1000 * i + 17))
            rows.append(judge(mode, rate, results))
            print(line(rows[-1]), flush=True)
            time.sleep(args.settle)
    finally:
        proc.terminate()
        proc.wait()
    return rows


def line(r: Row) -> str:
    per = " ".join(f"{b}={w}/{n}" for b, (w, n) in r.within.items())
    return (f"{r.mode:13} {r.rate:5.2f} req/s  offered {r.offered:4d}  refused {r.refused:4d}  failed {r.failed:3d}  "
            f"within {per}  goodput {r.goodput:.2f} req/s  p0 admitted within {r.p0_admitted_within:.0%}  "
            f"refusal p99 {r.refusal_p99_ms:.0f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.5,1,2,3,6")
    p.add_argument("--duration", type=float, default=45.0)
    p.add_argument("--settle", type=float, default=10.0, help="seconds between rates, for the queue to drain")
    p.add_argument("--modes", default="slo-predicted,off")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="admission-"))
    proc, engine = start(["serve", "--dtype", args.dtype, "--bucket-priorities",
                          ",".join(f"{k}={v}" for k, v in PRIORITY.items()),
                          "--bucket-tpot-ms", ",".join(f"{b.name}={round(b.tpot_slo * 1000)}" for b in MIX)],
                         logs / "engine.log")
    try:
        asyncio.run(wait_ready(engine))
        rows = [r for mode in args.modes.split(",") for r in run(mode, rates, args, logs, engine)]
    finally:
        proc.terminate()
        proc.wait()
    print(f"\nlogs: {logs}\n| mode | offered req/s | offered | refused | failed | within SLO | goodput req/s | "
          "p0 admitted within | refusal p99 ms |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        within = sum(w for w, _ in r.within.values())
        print(f"| {r.mode} | {r.rate:g} | {r.offered} | {r.refused} | {r.failed} | {within / max(1, r.offered):.0%} | "
              f"{r.goodput:.2f} | {r.p0_admitted_within:.0%} | {r.refusal_p99_ms:.0f} |")


if __name__ == "__main__":
    main()
