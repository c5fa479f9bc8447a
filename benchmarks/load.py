"""Load test: Poisson arrivals of a chat / long-document / long-output mix, streaming, at increasing
rates; per-bucket TTFT/TPOT P50/P95 and SLO attainment, for slofleet and (optionally) transformers serve.

    .venv/bin/python benchmarks/load.py --rates 0.5 1 2 --duration 60 [--transformers-serve]

Starts its own servers on loopback (slofleet serve; `transformers serve --continuous-batching` when asked)
and sends traffic only to them. Long documents (1,000+ tokens) prefill while chats arrive.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

from slofleet.bench.loadgen import Bucket, Result, percentile, stream_one

BUCKETS = [
    Bucket("chat", (20, 60), 48, ttft_slo=2.0, tpot_slo=0.25, share=0.7),
    Bucket("doc", (900, 1100), 32, ttft_slo=20.0, tpot_slo=0.5, share=0.15),
    Bucket("long-output", (20, 40), 192, ttft_slo=4.0, tpot_slo=0.25, share=0.15),
]


def start(cmd: list[str], url: str, log: Path, ready_path: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: see {log}")
        try:
            if httpx.get(url + ready_path, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{cmd} not ready; see {log}")


async def run_rate(url: str, model: str, rate: float, duration: float, seed: int, ignore_eos: bool) -> list[Result]:
    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        t_end = time.monotonic() + duration
        while time.monotonic() < t_end:
            b = rng.choices(BUCKETS, [b.share for b in BUCKETS])[0]
            tasks.append(asyncio.create_task(stream_one(client, url, b.body(model, rng), b.name,
                                                        send_ignore_eos=ignore_eos)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


async def warm_up(url: str, model: str, ignore_eos: bool) -> None:
    # transformers serve loads its model on the first request: keep that out of the measured TTFTs
    async with httpx.AsyncClient(timeout=600) as client:
        await stream_one(client, url, BUCKETS[0].body(model, random.Random(1)), "chat", send_ignore_eos=ignore_eos)


def report(system: str, rate: float, results: list[Result]) -> dict:
    rows = {}
    for b in BUCKETS:
        rs = [r for r in results if r.bucket == b.name]
        ok = [r for r in rs if r.status == 200 and r.ttft is not None]
        met = [r for r in ok if r.ttft <= b.ttft_slo and r.tpot <= b.tpot_slo]
        rows[b.name] = dict(n=len(rs), ttft50=percentile([r.ttft for r in ok], 50),
                            ttft95=percentile([r.ttft for r in ok], 95), tpot50=percentile([r.tpot for r in ok], 50),
                            tpot95=percentile([r.tpot for r in ok], 95), slo=len(met) / max(1, len(rs)),
                            tokens=sum(r.tokens for r in ok) / max(1, len(ok)))
        r = rows[b.name]
        print(f"{system:18s} {rate:5.2f} {b.name:12s} {r['n']:4d} {r['ttft50']:8.2f} {r['ttft95']:8.2f} "
              f"{r['tpot50'] * 1000:8.0f} {r['tpot95'] * 1000:8.0f} {r['slo'] * 100:6.0f}% {r['tokens']:6.0f}",
              flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--duration", type=float, default=60, help="seconds of arrivals per rate")
    ap.add_argument("--transformers-serve", action="store_true",
                    help="also run transformers serve --continuous-batching")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256,
                    help="slofleet's step budget: a smaller one bounds how long a chat waits behind a document chunk")
    args = ap.parse_args()
    from slofleet.engine import loader
    path = loader.resolve("default")
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    systems = [("slofleet", [sys.executable, "-m", "slofleet.cli", "serve", "--port", str(args.port),
                             "--bucket-priorities", "chat=0,long-output=1,doc=2",
                             "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
                f"http://127.0.0.1:{args.port}", "/ready", "SmolLM2-135M-Instruct", True)]
    if args.transformers_serve:
        cli = str(Path(sys.executable).with_name("transformers"))
        systems.append(("transformers serve", [cli, "serve", "--continuous-batching", "--port", str(args.port + 1),
                                               str(path)], f"http://127.0.0.1:{args.port + 1}",
                        "/health", str(path), False))
    print("SLOs: " + ", ".join(f"{b.name} TTFT<={b.ttft_slo}s TPOT<={b.tpot_slo * 1000:.0f}ms ({b.share:.0%})"
                                for b in BUCKETS))
    print(f"{'system':18s} {'rate':>5s} {'bucket':12s} {'n':>4s} {'TTFT50':>8s} {'TTFT95':>8s} {'TPOT50ms':>8s} "
          f"{'TPOT95ms':>8s} {'SLO':>7s} {'outtok':>6s}")
    for name, cmd, url, ready, model, ignore_eos in systems:
        proc = start(cmd, url, logs / f"load-{name.replace(' ', '_')}.log", ready)
        try:
            asyncio.run(warm_up(url, model, ignore_eos))
            for rate in args.rates:
                report(name, rate, asyncio.run(run_rate(url, model, rate, args.duration, 0, ignore_eos)))
        finally:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
