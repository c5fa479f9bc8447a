"""Mixed chat + long-document load through the router: disaggregated and prefix-aware vs round-robin.

Poisson arrivals for `--duration` seconds: short chats (20-60 words, chat bucket, priority 0) and long documents
(~1,000+ tokens, doc bucket, priority 5). Round-robin runs `--engines` unified engines; disaggregated runs one
prefill engine and `--engines - 1` decode engines behind `--policy prefix`, so document prompts are prefilled away
from the replicas that stream the chats. Prints chat and document TTFT P50/P95 per mode side by side, and chat
TTFT SLO attainment.

    .venv/bin/python benchmarks/router_mixed.py --engines 2 --rate 0.7 --doc-share 0.3 --duration 180
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from router_prefix import MODEL, start, wait_ready  # noqa: E402

from slofleet.bench.loadgen import Bucket, Result, percentile, stream_one  # noqa: E402

ROUTER_BUCKETS = {"buckets": [
    {"name": "chat", "priority": 0, "match": {"maxPromptTokens": 400}, "slo": {"ttftMs": 1000}},
    {"name": "doc", "priority": 5, "match": {"minPromptTokens": 401}, "slo": {"ttftMs": 30000}}]}


def mix(args: argparse.Namespace) -> list[Bucket]:
    return [Bucket("chat", (20, 60), args.max_tokens, args.chat_ttft_slo, 1.0, 1 - args.doc_share),
            Bucket("doc", (800, 900), args.max_tokens, 60.0, 1.0, args.doc_share)]


async def drive(router: str, args: argparse.Namespace) -> list[Result]:
    rng, buckets = random.Random(args.seed), mix(args)  # the same arrivals and prompts in both modes
    tasks, t_end = [], time.monotonic() + args.duration
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)) as c:
        while time.monotonic() < t_end:
            b = rng.choices(buckets, weights=[b.share for b in buckets])[0]
            tasks.append(asyncio.create_task(stream_one(c, router, b.body(MODEL, rng), b.name)))
            await asyncio.sleep(rng.expovariate(args.rate))
        return list(await asyncio.gather(*tasks))


def handed_off(router: str) -> int:
    """Requests the router prefilled on a prefill replica (its slofleet:router_pd_routes counter)."""
    text = httpx.get(router + "/metrics", timeout=10).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("slofleet:router_pd_routes_total") and 'route="disaggregated"' in line))


def run_mode(mode: str, args: argparse.Namespace, logs: Path) -> tuple[list[Result], int]:
    engine = ["serve", "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--num-threads", str(args.threads)]
    roles = ["unified"] * args.engines if mode == "round-robin" else ["prefill"] + ["decode"] * (args.engines - 1)
    procs, flags = [], []
    try:
        for i, role in enumerate(roles):
            proc, url = start([*engine, "--role", role], logs / f"{mode}-engine{i}-{role}.log")
            procs.append(proc)
            flags += [f"--{'' if role == 'unified' else role + '-'}upstream", url]
            asyncio.run(wait_ready(url))
        policy = ["--policy", "round-robin"] if mode == "round-robin" else [
            "--policy", "prefix", "--prefill-threshold-tokens", str(args.threshold)]
        (logs / "buckets.json").write_text(json.dumps(ROUTER_BUCKETS))
        proc, router = start(["router", "--log-level", "warning", "--buckets", str(logs / "buckets.json"), *policy,
                              *flags], logs / f"{mode}-router.log")
        procs.append(proc)
        asyncio.run(wait_ready(router))
        time.sleep(1.5)  # let the router probe every replica ready
        return asyncio.run(drive(router, args)), handed_off(router)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=2, help="engine processes per mode (disaggregated: 1 prefill)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per mode")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--doc-share", type=float, default=0.2, help="share of long-document requests")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chat-ttft-slo", type=float, default=1.0, help="seconds")
    p.add_argument("--threshold", type=int, default=512, help="--prefill-threshold-tokens of the router")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (engines share the cores)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="per engine; in disaggregated mode the decode engines also hold every document's decode")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="per engine step: large chunks prefill documents efficiently, but a unified engine's chats "
                        "then wait behind a whole document chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="round-robin,disaggregated")
    p.add_argument("--logs", default="/tmp/router_mixed")
    args = p.parse_args()
    if args.engines < 2:
        p.error("--engines must be at least 2 (disaggregated needs a prefill and a decode engine)")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    rows = {mode: run_mode(mode, args, logs) for mode in args.modes.split(",")}
    print(f"{args.engines} engines; {args.duration:g} s at {args.rate:g} req/s, {args.doc_share:.0%} documents of "
          f"~1,000+ tokens, {args.max_tokens} output tokens; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'mode':<14} {'chat n':>6} {'chat TTFT P50':>13} {'P95':>7} {'<= SLO':>7} {'doc n':>6} "
          f"{'doc TTFT P50':>12} {'P95':>7} {'errors':>6} {'handed off':>10}")
    for mode, (results, handed) in rows.items():
        ok = {b: [r.ttft for r in results if r.bucket == b and r.ttft is not None] for b in ("chat", "doc")}
        chats = [r for r in results if r.bucket == "chat"]
        met = sum(r.ttft is not None and r.ttft <= args.chat_ttft_slo for r in chats) / max(len(chats), 1)
        errors = sum(r.status != 200 or r.error != "" for r in results)
        print(f"{mode:<14} {len(ok['chat']):>6} {percentile(ok['chat'], 50):>13.3f} {percentile(ok['chat'], 95):>7.3f} "
              f"{met:>7.0%} {len(ok['doc']):>6} {percentile(ok['doc'], 50):>12.3f} {percentile(ok['doc'], 95):>7.3f} "
              f"{errors:>6} {handed:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
