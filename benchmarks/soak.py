"""Soak test: 1,000 streaming requests, a random third of them disconnecting mid-stream.

Passes when no request got a 5xx, KV usage and running requests return to 0, and the server's resident
memory after the run is within 10% of its memory after a warm-up.

    .venv/bin/python benchmarks/soak.py [--requests 1000] [--concurrency 16]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load import start  # noqa: E402

from slofleet.bench.loadgen import Bucket, stream_one  # noqa: E402

SHAPE = Bucket("soak", (5, 80), 24, ttft_slo=0, tpot_slo=0, share=1)


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def wave(url: str, n: int, concurrency: int, seed: int) -> list:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def one():
            async with sem:
                cancel = rng.randint(1, 10) if rng.random() < 1 / 3 else None
                return await stream_one(client, url, SHAPE.body("SmolLM2-135M-Instruct", rng), "soak", cancel)
        return await asyncio.gather(*[one() for _ in range(n)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--port", type=int, default=8120)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    proc = start([sys.executable, "-m", "slofleet.cli", "serve", "--port", str(args.port)], url,
                 Path("/tmp/soak-server.log"), "/ready")
    try:
        asyncio.run(wave(url, 50, args.concurrency, 1))
        base = rss_mb(proc.pid)
        t0 = time.monotonic()
        results = asyncio.run(wave(url, args.requests, args.concurrency, 2))
        took = time.monotonic() - t0
        time.sleep(1)
        end = rss_mb(proc.pid)
        kv, running = gauge(url, "vllm:kv_cache_usage_perc"), gauge(url, "vllm:num_requests_running")
    finally:
        proc.terminate()
        proc.wait(60)
    codes: dict[int, int] = {}
    for r in results:
        codes[r.status] = codes.get(r.status, 0) + 1
    five_xx = sum(n for c, n in codes.items() if c >= 500 or c == 0)
    print(f"requests {len(results)} in {took:.0f}s; status counts {dict(sorted(codes.items()))} (499 = client left)")
    print(f"5xx/transport errors: {five_xx}; KV usage after: {kv:.3f}; running after: {running:.0f}")
    print(f"server RSS after warm-up {base:.0f} MB, after soak {end:.0f} MB ({(end - base) / base:+.1%})")
    ok = five_xx == 0 and kv == 0 and running == 0 and end <= base * 1.10
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
