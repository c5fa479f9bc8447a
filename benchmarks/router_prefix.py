"""Prefix-aware routing against round-robin, on real engines: TTFT when requests share long prefixes.

The workload: `--docs` distinct documents of `--doc-words` words; every request is one document (picked at random)
plus its own question. Each engine's KV pool (`--num-blocks`) holds about half the documents, the fleet all of
them: round-robin makes every replica cycle through every document and evict, prefix-aware routing keeps each
document on one replica where its blocks stay cached. Each policy gets its own fresh documents, so neither starts
with the other's warm cache.

TTFT is bimodal here (a cached document answers in about a tenth of the time), so P50 falls in whichever mode holds
most requests. Round-robin's hit rate is about the share of documents one replica holds, at least 1/engines when
the fleet holds them all: with 2 engines it sits near 50% and its P50 flips between runs; the defaults use 3.

    .venv/bin/python benchmarks/router_prefix.py --engines 3 --docs 6 --requests 80

Issue #16's multi-tenant run: 8 tenants of ~1,515 tokens (together 2.05x one engine's KV), engine 0 restarted
halfway, round-robin vs prefix hashing vs the event index (about 15 minutes on 2 cores):

    .venv/bin/python benchmarks/router_prefix.py --docs 8 --doc-words 1470 --num-blocks 370 --requests 320 --restart
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
WORDS = ("harbor lantern river quiet market theory planet letter forest winter machine story bridge circuit memory "
         "ocean desert village candle rhythm garden window copper silver meadow thunder valley orchard").split()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path, host: str = "127.0.0.1", port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "slofleet.cli", *cmd, "--host", host, "--port", str(port)],
                            cwd=ROOT, stdout=open(log, "a"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://{host}:{port}"


async def wait_ready(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise TimeoutError(url)


async def prefix_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0  # an engine restarted mid-run starts again from 0: runs read the sum of their deltas
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.get(u + "/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith("vllm:prefix_cache_hits_total"):
                        hits += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:prefix_cache_queries_total"):
                        queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def run_workload(router: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[float]:
    """TTFT of each prompt: request sent to the first streamed token."""
    sem, ttfts = asyncio.Semaphore(concurrency), []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def one(prompt: str) -> None:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            async with sem:
                t0 = time.perf_counter()
                async with s.post(router + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{r.status}: {await r.text()}")
                    async for line in r.content:
                        if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                            ttfts.append(time.perf_counter() - t0)
                            break
                    async for _ in r.content.iter_any():
                        pass
        await asyncio.gather(*(one(p) for p in prompts))
    return ttfts


def workload(seed: str, docs: int, doc_words: int, requests: int) -> list[str]:
    rng = random.Random(seed)
    texts = [f"Document {seed}-{d}. " + " ".join(rng.choice(WORDS) for _ in range(doc_words)) for d in range(docs)]
    return [rng.choice(texts) + f"\nQuestion {i}: which word comes first?" for i in range(requests)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--docs", type=int, default=6, help="distinct shared prefixes per policy")
    p.add_argument("--doc-words", type=int, default=300)
    p.add_argument("--num-blocks", type=int, default=64, help="KV blocks per engine (16 tokens each)")
    p.add_argument("--requests", type=int, default=80, help="requests per policy")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (engines share the cores)")
    p.add_argument("--policies", default="round-robin,prefix,precise",
                   help="precise: the router's event index (engines publish KV events)")
    p.add_argument("--restart", action="store_true", help="restart one engine halfway through each policy's run")
    p.add_argument("--logs", default="/tmp/router_prefix")
    args = p.parse_args()
    events, replay = free_port(), free_port()  # one port pair, each engine on its own loopback address
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    procs, urls = [], []
    try:
        engine_cmds = [["serve", "--dtype", "float32", "--num-blocks", str(args.num_blocks), "--max-num-seqs", "4",
                        "--num-threads", str(args.threads), "--kv-events-endpoint", f"tcp://127.0.0.{i + 2}:{events}",
                        "--kv-events-replay-endpoint", f"tcp://127.0.0.{i + 2}:{replay}"] for i in range(args.engines)]
        for i, cmd in enumerate(engine_cmds):
            proc, url = start(cmd, logs / f"engine{i}.log", f"127.0.0.{i + 2}")
            procs.append(proc)
            urls.append(url)

        def restart() -> None:  # engine 0: its cache (and, for the index, its epoch) starts over
            procs[0].terminate()
            procs[0].wait(30)
            procs[0] = start(engine_cmds[0], logs / "engine0.log", "127.0.0.2", int(urls[0].rsplit(":", 1)[1]))[0]
            asyncio.run(wait_ready(urls[0]))
        for u in urls:
            asyncio.run(wait_ready(u))
        rows = []
        for policy in args.policies.split(","):
            precise = ["--model", "default", "--kv-events-endpoint", f"tcp://{{host}}:{events}",
                       "--kv-events-replay-endpoint", f"tcp://{{host}}:{replay}"] if policy == "precise" else []
            proc, router = start(["router", "--policy", policy, "--log-level", "warning", *precise,
                                  *[f for u in urls for f in ("--upstream", u)]], logs / f"router-{policy}.log")
            procs.append(proc)
            asyncio.run(wait_ready(router))
            time.sleep(1.5)  # let the router probe every replica ready (and subscribe to their events)
            prompts = workload(policy, args.docs, args.doc_words, args.requests)
            halves = (prompts[:len(prompts) // 2], prompts[len(prompts) // 2:]) if args.restart else (prompts,)
            ttfts, hits, queries = [], 0.0, 0.0
            for i, part in enumerate(halves):
                if i:
                    restart()
                    time.sleep(1.5)  # the router sees it ready again
                before = asyncio.run(prefix_counters(urls))
                ttfts.append(run_workload_sync(router, part, args))
                after = asyncio.run(prefix_counters(urls))
                hits, queries = hits + after[0] - before[0], queries + after[1] - before[1]
            index = asyncio.run(router_gauge(router, "slofleet:router_prefix_index_bytes"))
            flat = [t for part in ttfts for t in part]
            rows.append((policy, statistics.median(flat), statistics.quantiles(flat, n=20)[18],
                         statistics.quantiles(ttfts[-1], n=20)[18], hits / max(queries, 1), index))
            proc.terminate()
            proc.wait(10)
        print(f"{args.engines} engines x {args.num_blocks} KV blocks; {args.docs} documents of ~{args.doc_words} "
              f"words; {args.requests} requests per policy at concurrency {args.concurrency}; "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        print(f"{'policy':<12} {'TTFT P50 s':>11} {'P95 s':>8} {'P95 after restart':>18} {'prefix hit rate':>16} "
              f"{'index KiB':>10}")
        for policy, p50, p95, p95_after, hr, index in rows:
            print(f"{policy:<12} {p50:>11.3f} {p95:>8.3f} {p95_after if args.restart else float('nan'):>18.3f} "
                  f"{hr:>16.1%} {index / 1024:>10.0f}")
        for policy, p50, *_ in rows[1:]:
            print(f"{policy} TTFT P50 vs {rows[0][0]}: {1 - p50 / rows[0][1]:+.0%} reduction")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    return 0


async def router_gauge(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in (await r.text()).splitlines() if line.startswith(name))


def run_workload_sync(router: str, prompts: list[str], args: argparse.Namespace) -> list[float]:
    return asyncio.run(run_workload(router, prompts, args.concurrency, args.max_tokens))


if __name__ == "__main__":
    sys.exit(main())
