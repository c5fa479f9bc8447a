"""Load test: Poisson arrivals of issue #14's mix (slofleet.bench.loadgen.MIX: 60% short chats with 24 output
tokens, 25% ~500-token documents sharing a 120-word head with 8, 15% long outputs of 64), sustained at each rate;
per-bucket TTFT/TPOT P50/P95 and the share of requests within their SLOs, for slofleet and (optionally)
transformers serve, vLLM's CPU build and llama.cpp's llama-server, side by side in one run.

    .venv/bin/python benchmarks/load.py [--rates 4] [--requests 240] [--transformers-serve] [--vllm] [--llamacpp]

--vllm and --llamacpp start the peers that `make install-runtimes` cached (slofleet.bench.runtimes): vLLM on
`slofleet export-hf`'s directory of the embedded model, llama-server on the embedded GGUF itself, each with the
same sequence limit and context as slofleet serve's (--max-num-seqs, --max-model-len).

Requests are as a plain OpenAI client sends them: streaming /v1/completions with stream_options.include_usage, no
bucket header, priority or ignore_eos (the bucket only labels the result). Starts its own servers on loopback
(`slofleet serve` with no flags unless --slofleet-args; `transformers serve --continuous-batching` when asked) and
sends traffic only to them.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
from collections import Counter
from pathlib import Path

import httpx

from slofleet.bench import runtimes
from slofleet.bench.loadgen import MIX, Bucket, Result, percentile, stream_one
from slofleet.engine import loader


async def run_rate(url: str, model: str, rate: float, requests: int, seed: int, give_up: float) -> list[Result]:
    """The requests' results; those still running `give_up` seconds after the last arrival are cancelled and count
    as failed (a server that far behind has missed their SLOs long before)."""
    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        for _ in range(requests):
            b = rng.choices(MIX, [b.share for b in MIX])[0]
            tasks.append((b.name, asyncio.create_task(send(client, url, b.body(model, rng, completion=True), b.name))))
            await asyncio.sleep(rng.expovariate(rate))
        _, late = await asyncio.wait([t for _, t in tasks], timeout=give_up)
        for t in late:
            t.cancel()
        return [Result(name, 0, error="gave up") if t in late else t.result() for name, t in tasks]


def send(client: httpx.AsyncClient, url: str, body: dict, bucket: str):
    return stream_one(client, url, body, bucket, send_ignore_eos=False, path="/v1/completions", send_bucket=False)


async def warm_up(url: str, model: str) -> None:
    # transformers serve loads its model on the first request: keep that out of the measured TTFTs
    async with httpx.AsyncClient(timeout=600) as client:
        await send(client, url, MIX[0].body(model, random.Random(1), completion=True), "chat")


def within(r: Result, b: Bucket) -> bool:
    return r.status == 200 and r.ttft is not None and r.ttft <= b.ttft_slo and r.tpot <= b.tpot_slo


def report(system: str, rate: float, results: list[Result]) -> dict:
    rows, slo = {}, {b.name: b for b in MIX}
    for b in MIX:
        rs = [r for r in results if r.bucket == b.name]
        ok = [r for r in rs if r.status == 200 and r.ttft is not None]
        rows[b.name] = dict(n=len(rs), ttft50=percentile([r.ttft for r in ok], 50),
                            ttft95=percentile([r.ttft for r in ok], 95), tpot50=percentile([r.tpot for r in ok], 50),
                            tpot95=percentile([r.tpot for r in ok], 95),
                            slo=sum(within(r, b) for r in rs) / max(1, len(rs)),
                            tokens=sum(r.tokens for r in ok) / max(1, len(ok)))
        r = rows[b.name]
        print(f"{system:18s} {rate:5.2f} {b.name:12s} {r['n']:4d} {r['ttft50']:8.2f} {r['ttft95']:8.2f} "
              f"{r['tpot50'] * 1000:8.0f} {r['tpot95'] * 1000:8.0f} {r['slo'] * 100:6.1f}% {r['tokens']:6.1f}",
              flush=True)
    ok = [r for r in results if r.status == 200 and r.e2e is not None]
    # over the answered ones: a given-up request has no send time of its own
    span = max((r.start + r.e2e for r in ok), default=0.0) - min((r.start for r in ok), default=0.0)
    met = sum(within(r, slo[r.bucket]) for r in results) / max(1, len(results))
    why = Counter(r.error or f"status {r.status}" for r in results if not (r.status == 200 and r.e2e is not None))
    failed = f"{len(results) - len(ok)} failed" + (f" ({', '.join(f'{n} x {e[:60]}' for e, n in why.items())})"
                                                   if why else "")
    print(f"{system:18s} {rate:5.2f} {'ALL':12s} {len(results):4d}  within SLO {met * 100:.1f}%, {failed}, "
          f"{sum(r.tokens for r in ok) / max(span, 1e-9):.1f} output tok/s", flush=True)
    return rows | {"all": dict(n=len(results), slo=met, failed=len(results) - len(ok))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0], help="requests per second, one run each")
    ap.add_argument("--requests", type=int, default=240, help="requests per rate")
    ap.add_argument("--give-up", type=float, default=120, help="seconds after the last arrival to cancel the rest")
    ap.add_argument("--transformers-serve", action="store_true",
                    help="also run transformers serve --continuous-batching")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build from the runtimes cache")
    ap.add_argument("--llamacpp", action="store_true", help="also run llama-server from the runtimes cache")
    ap.add_argument("--vllm-args", default="", help="extra flags for vllm serve")
    ap.add_argument("--llamacpp-args", default="", help="extra flags for llama-server")
    ap.add_argument("--max-num-seqs", type=int, default=runtimes.Shape().max_num_seqs,
                    help="concurrent sequences, the same for every runtime")
    ap.add_argument("--max-model-len", type=int, default=runtimes.Shape().max_model_len,
                    help="context per sequence, the same for every runtime")
    ap.add_argument("--port", type=int, default=8100, help="slofleet's port; the others take the next ones")
    ap.add_argument("--slofleet-args", default="", help="flags for slofleet serve (default: none)")
    args = ap.parse_args()
    for name in ("vllm", "llamacpp"):
        if getattr(args, name) and runtimes.find(name) is None:
            ap.error(runtimes.missing_reason(name))
    path = loader.resolve("default")
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    shape = runtimes.Shape(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    systems = [runtimes.own(args.port, shape, shlex.split(args.slofleet_args))]
    if args.transformers_serve:
        cli = str(Path(sys.executable).with_name("transformers"))
        systems.append(runtimes.Launch(runtime="transformers serve", cmd=[
            cli, "serve", "--continuous-batching", "--port", str(args.port + 1), str(path)],
            url=f"http://127.0.0.1:{args.port + 1}", ready_path="/health", model=str(path)))
    if args.vllm:
        systems.append(runtimes.launch(runtimes.VLLM, args.port + 2, shape, shlex.split(args.vllm_args)))
    if args.llamacpp:
        systems.append(runtimes.launch(runtimes.LLAMACPP, args.port + 3, shape, shlex.split(args.llamacpp_args)))
    print("SLOs: " + ", ".join(f"{b.name} TTFT<={b.ttft_slo}s TPOT<={b.tpot_slo * 1000:.0f}ms ({b.share:.0%})"
                                for b in MIX))
    print(f"{'system':18s} {'rate':>5s} {'bucket':12s} {'n':>4s} {'TTFT50':>8s} {'TTFT95':>8s} {'TPOT50ms':>8s} "
          f"{'TPOT95ms':>8s} {'SLO':>7s} {'outtok':>6s}")
    for s in systems:
        proc = runtimes.start(s, logs / f"load-{s.runtime.replace(' ', '_')}.log")
        try:
            asyncio.run(warm_up(s.url, s.model))
            # a seed per rate: the same server would otherwise answer a later rate's prompts from its prefix cache
            for seed, rate in enumerate(args.rates):
                results = asyncio.run(run_rate(s.url, s.model, rate, args.requests, seed, args.give_up))
                report(s.runtime, rate, results)
        finally:
            runtimes.stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
