"""`slofleet bench`: replay a real trace (or a synthetic chat / document / long-output mix) against any
OpenAI-compatible URL, open-loop: each request leaves at its arrival time whether or not earlier ones finished.
Prints per-bucket TTFT/TPOT/E2E percentiles, and with --buckets (an LLMService or SLOPolicy file, or one with only
spec.buckets) attainment and goodput against each bucket's SLO. --json prints one object with `vllm bench
serve`'s field names; --png plots latency CDFs per bucket and attainment over time. Progress goes to stderr.

Prompts are made of words that are one token each for most tokenizers, so their lengths are as in the trace;
--max-prompt-tokens and --max-output-tokens clip them for small servers. The bucket of each request is sent as
the x-slofleet-bucket header (an engine labels its metrics with it; a router classifies by its own rules)."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
import time
import urllib.parse
from pathlib import Path

from slofleet.api.contract import RUNTIMES, SLOFLEET

from . import workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (an engine, a router, any "
                   "OpenAI-compatible API), without /v1")
    p.add_argument("--model", help="default: the first of the server's /v1/models")
    p.add_argument("--endpoint", default="/v1/chat/completions", choices=["/v1/chat/completions", "/v1/completions"])
    p.add_argument("--trace", default="synthetic", choices=["synthetic", *workload.TRACES],
                   help="synthetic: the chat/doc/long-output mix, Poisson arrivals; else a real trace "
                   "(../shared/data/traces: Azure 2023 conversation and code, Mooncake's long conversations)")
    p.add_argument("--request-rate", "--rate", type=float, help="requests per second (inf: all at once); a trace is "
                   "time-scaled to it (default: its recorded timing); the synthetic mix needs it")
    p.add_argument("--num-prompts", type=int, help="requests to send (default: all within --duration)")
    p.add_argument("--duration", type=float, help="seconds of arrivals (default 60 when --num-prompts is unset)")
    p.add_argument("--buckets", help="YAML/JSON with the buckets (an LLMService, an SLOPolicy, or spec.buckets): "
                   "classifies each request and gives the SLOs")
    p.add_argument("--max-prompt-tokens", type=int, help="clip prompts to this")
    p.add_argument("--max-output-tokens", type=int, help="clip max_tokens to this")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens each (vLLM's field; slofleet's too)")
    p.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles to report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token ($OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the table")
    p.add_argument("--png", help="write latency CDFs per bucket and attainment over time to this PNG")
    p.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines on stderr")
    p.add_argument("--runtimes", metavar="LIST", help="comma-separated, of slofleet, vllm, llamacpp: start each in "
                   "turn on loopback with the embedded model and one shared shape (slofleet.bench.runtimes; vllm and "
                   "llamacpp from `make install-runtimes`), send each the same requests, print one table; --url "
                   "and --model are then unused")
    p.add_argument("--sweep", metavar="RATES", help="comma-separated request rates, run one after another, each with "
                   "its own seed (--seed + its index: fresh prompts): prints offered, admitted, refused and goodput "
                   "per bucket at each, and the knee (SLOs from --buckets; the synthetic mix has its own); --png plots "
                   "the curve and writes the table beside it (.txt)")


def items_of(args: argparse.Namespace) -> list[workload.Item]:
    duration = args.duration if args.duration is not None or args.num_prompts else 60.0
    if args.trace == "synthetic":
        if args.request_rate is None:
            raise SystemExit("slofleet bench: the synthetic mix needs --request-rate")
        try:
            items = workload.synthetic(args.request_rate, args.num_prompts, duration, args.seed)
        except ValueError as e:
            raise SystemExit(f"slofleet bench: {e}") from None
    else:
        items = workload.replay(args.trace, args.request_rate, args.num_prompts, duration, args.seed)
    workload.clip(items, args.max_prompt_tokens, args.max_output_tokens)
    return items


async def drive(args: argparse.Namespace, url: str, model: str, items: list[workload.Item],
                headers: dict[str, str]):
    import httpx

    from .loadgen import stream_one

    done: list = []
    async with httpx.AsyncClient(timeout=args.timeout, limits=httpx.Limits(max_connections=None)) as client:
        origin = time.perf_counter()

        async def one(it: workload.Item):
            r = await stream_one(client, url, workload.body(it, model, args.endpoint, args.ignore_eos),
                                 it.bucket, path=args.endpoint, headers=headers, origin=origin)
            done.append(r)
            return r

        async def progress():
            while True:
                await asyncio.sleep(args.progress_interval)
                failed = sum(r.status != 200 or r.ttft is None for r in done)
                print(f"slofleet bench: {time.perf_counter() - origin:6.1f} s, {len(tasks)}/{len(items)} sent, "
                      f"{len(done)} done ({failed} failed), {len(tasks) - len(done)} in flight",
                      file=sys.stderr, flush=True)

        tasks: list[asyncio.Task] = []
        reporter = asyncio.create_task(progress())
        for it in items:
            await asyncio.sleep(max(0.0, origin + it.at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(it)))
        results = await asyncio.gather(*tasks)
        reporter.cancel()
        return list(results), time.perf_counter() - origin


def first_model(url: str, headers: dict[str, str]) -> str:
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"slofleet bench: no model listed at {url}/v1/models ({e!r}); pass --model") from None


def problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, in one line, or None."""
    u = urllib.parse.urlsplit(args.url)
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"--url must be http(s)://HOST[:PORT], got {args.url!r}"
    for flag, value, least in (("--request-rate", args.request_rate, 0), ("--duration", args.duration, 0),
                               ("--timeout", args.timeout, 0), ("--progress-interval", args.progress_interval, 0)):
        if value is not None and not value > least:  # NaN too
            return f"{flag} must be above {least}, got {value:g}"
    if args.duration is not None and math.isinf(args.duration):
        return "--duration must be finite (or give --num-prompts)"
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-prompt-tokens", args.max_prompt_tokens),
                        ("--max-output-tokens", args.max_output_tokens)):
        if value is not None and value < 1:
            return f"{flag} must be at least 1, got {value}"
    try:
        if not all(0 < float(p) < 100 for p in args.metric_percentiles.split(",") if p.strip()):
            raise ValueError
    except ValueError:
        return f"--metric-percentiles must be comma-separated numbers in (0, 100), got {args.metric_percentiles!r}"
    return None


def run(args: argparse.Namespace) -> int:
    from . import report

    if wrong := problem(args):
        print(f"slofleet bench: {wrong}", file=sys.stderr)
        return 2
    if args.sweep is not None:
        return run_sweep(args)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    headers = auth_headers(args)
    targets: dict[str, workload.Target] = {}
    items = items_of(args)
    if args.buckets:
        loaded = bucket_targets(args.buckets)
        if loaded is None:
            return 2
        classifier, targets = loaded
        workload.classify(items, classifier, args.endpoint)
    if not items:
        raise SystemExit("slofleet bench: no requests to send (see --num-prompts, --duration)")
    if args.runtimes:
        return side_by_side(args, items, targets, percentiles)
    model = args.model or first_model(args.url, headers)
    s = measure(args, args.url, model, items, targets, percentiles, headers)
    print(json.dumps(s, indent=1) if args.json else report.table(s, percentiles))
    return 0 if s["completed"] else 1  # nothing answered: a script should not read figures


def side_by_side(args: argparse.Namespace, items: list[workload.Item], targets: dict[str, workload.Target],
                 percentiles: list[float]) -> int:
    """--runtimes: the same requests to each runtime started in turn, one table (or one JSON object by runtime)."""
    from . import runtimes

    names = args.runtimes.split(",")
    problems = [f"unknown runtime {n!r} (give some of {', '.join(RUNTIMES)})" for n in names if n not in RUNTIMES]
    problems += [runtimes.missing_reason(n) for n in names if n in RUNTIMES and n != SLOFLEET and not runtimes.find(n)]
    if problems:
        print(f"slofleet bench: --runtimes: {problems[0]}", file=sys.stderr)
        return 2
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    figures = runtimes.side_by_side(names, lambda one: measure(args, one.url, one.model, items, targets,
                                                               percentiles, {}), logs)
    print(json.dumps(figures, indent=1) if args.json else runtimes.side_table(figures, percentiles))
    return 0 if all(s["completed"] for s in figures.values()) else 1


def measure(args: argparse.Namespace, url: str, model: str, items: list[workload.Item],
            targets: dict[str, workload.Target], percentiles: list[float], headers: dict[str, str]) -> dict:
    """Send the requests to one server: its summary (report.summary), plotted with --png."""
    from . import report

    rate = args.request_rate
    workload_name = f"{args.trace} at {'its recorded rate' if rate is None else f'{rate:g} req/s'}"
    results, duration = asyncio.run(drive(args, url, model, items, headers))
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "backend": "openai-chat" if "chat" in
            args.endpoint else "openai", "url": url, "model_id": model, "model": model, "endpoint": args.endpoint,
            "workload": workload_name, "trace": args.trace,
            "request_rate": "inf" if rate is not None and math.isinf(rate) else rate}
    s = report.summary(results, duration, percentiles, targets, meta)
    s["errors"] = sorted({r.error for r in results if r.error})[:20]
    if args.png:
        report.plot(results, s, args.png)
    return s



def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    return {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def bucket_targets(path: str):
    """The --buckets file's classifier and SLO targets; None (said on stderr) when it does not load."""
    try:
        return workload.targets_of(path)
    except (OSError, ValueError) as e:
        print(f"slofleet bench: --buckets: {e}", file=sys.stderr)
        return None

def run_sweep(args: argparse.Namespace) -> int:
    """Each rate in turn, with its own seed; the table (or JSON) on stdout, the plot and the table beside it."""
    from . import sweep

    try:
        rates = sweep.parse_rates(args.sweep)
    except ValueError as e:
        print(f"slofleet bench: {e}", file=sys.stderr)
        return 2
    headers = auth_headers(args)
    classifier, targets = None, workload.mix_targets() if args.trace == "synthetic" else {}
    if args.buckets:
        loaded = bucket_targets(args.buckets)
        if loaded is None:
            return 2
        classifier, targets = loaded
    if not targets:
        print("slofleet bench: --sweep needs SLOs to count goodput: give --buckets", file=sys.stderr)
        return 2
    model = args.model or first_model(args.url, headers)
    points = []
    for i, rate in enumerate(rates):
        one = argparse.Namespace(**{**vars(args), "request_rate": rate, "seed": args.seed + i})
        items = items_of(one)
        if classifier is not None:
            workload.classify(items, classifier, args.endpoint)
        results, _ = asyncio.run(drive(one, args.url, model, items, headers))
        points.append(sweep.point(rate, one.seed, results, targets))
        t = points[-1].total
        print(f"slofleet bench: {rate:g} req/s: {t.offered} offered, {t.refused} refused, {t.failed} failed, "
              f"{t.attainment:.1%} within SLO", file=sys.stderr, flush=True)
    text = sweep.table(points)
    print(json.dumps(sweep.as_json(points), indent=1) if args.json else text)
    if args.png:
        with open(os.path.splitext(args.png)[0] + ".txt", "w") as f:
            f.write(text + "\n")
        if not sweep.plot(points, args.png, f"slofleet bench --sweep: {args.trace} against {args.url}"):
            print("slofleet bench: matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    return 0 if any(p.total.admitted for p in points) else 1
