"""`slofleet autoscaler`: scrape engine /metrics per role, decide, and act.

Two modes:
- `--kubernetes`: every LLMService with autoscaling enabled (see kubemode.py); its pods are found through the
  Kubernetes API and read directly or, with `--prometheus URL`, from Prometheus; decisions go to
  status.autoscaling.<role> and Events;
- `--target ROLE=URL` (local use): static engine URLs; each decision is only printed as a JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.parse

from slofleet.api.contract import DEFAULT_BUCKET, ROLES
from slofleet.api.v1alpha1 import Autoscaling

from .actuate import STALE_INTERVALS, WINDOW_INTERVALS
from .attainment import STATUS_WINDOW_S
from .policy import SLO, Fleet, Policy, PolicyConfig
from .signals import History, merge
from .sources import scrape

INTERVAL = Autoscaling.model_fields["interval_seconds"].default  # --target mode decides as a resource would


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kubernetes", action="store_true",
                   help="scale the LLMServices in the cluster (in-cluster config, else the kubeconfig)")
    p.add_argument("--namespace", "-n", default=None, help="with --kubernetes: only this namespace (default: all)")
    p.add_argument("--prometheus", default=None, metavar="URL",
                   help="with --kubernetes: read the engines' series from this Prometheus (/federate) instead of "
                        "scraping pods")
    p.add_argument("--resync", type=float, default=60.0,
                   help="with --kubernetes: rewrite an unchanged decision after this many seconds")
    p.add_argument("--status-window", type=float, default=STATUS_WINDOW_S,
                   help="with --kubernetes: seconds of requests each bucket's attainment in status.buckets covers")
    p.add_argument("--target", action="append", default=[], metavar="ROLE=URL",
                   help=f"an engine's base URL and its role ({', '.join(ROLES)}); repeat per pod")
    # The defaults are PolicyConfig's and SLO's, so the flags and the library cannot disagree.
    p.add_argument("--ttft", type=float, default=SLO.ttft_s, help="--target mode: TTFT target, seconds")
    p.add_argument("--tpot", type=float, default=SLO.tpot_s, help="--target mode: TPOT target, seconds")
    p.add_argument("--min-replicas", type=int, default=PolicyConfig.min_replicas,
                   help="--target mode (the resource's bounds otherwise)")
    p.add_argument("--max-replicas", type=int, default=PolicyConfig.max_replicas,
                   help="--target mode (the resource's bounds otherwise)")
    p.add_argument("--prefill-tps", type=float, default=PolicyConfig.prefill_tps,
                   help="prior: prompt tokens/s per replica")
    p.add_argument("--decode-tps", type=float, default=PolicyConfig.decode_tps,
                   help="prior: generated tokens/s per replica")
    p.add_argument("--cold-start", type=float, default=PolicyConfig.cold_start_s,
                   help="seconds from asking for a replica to its serving")
    p.add_argument("--interval", type=float, default=INTERVAL, help="--target mode: seconds between decisions")
    p.add_argument("--window", type=float, default=WINDOW_INTERVALS * INTERVAL,
                   help="--target mode: seconds of history each decision reads")
    p.add_argument("--iterations", type=int, default=0, help="stop after this many rounds (0: run forever)")


# flag -> whether 0 itself is allowed: every other number below 0 (or NaN, or infinite) is refused
NON_NEGATIVE = {"resync": False, "status_window": False, "ttft": False, "tpot": False, "prefill_tps": False,
                "decode_tps": False, "interval": False, "window": False, "cold_start": True, "min_replicas": True,
                "max_replicas": True, "iterations": True}


def problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, in one line, or None."""
    for name, zero in NON_NEGATIVE.items():
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            return f"--{name.replace('_', '-')} must be {'0 or more' if zero else 'above 0'}, got {value:g}"
    if args.min_replicas > args.max_replicas:
        return f"--min-replicas ({args.min_replicas}) must not be above --max-replicas ({args.max_replicas})"
    for item in args.target:
        role, _, url = item.partition("=")
        u = urllib.parse.urlsplit(url)
        if role not in ROLES or u.scheme not in ("http", "https") or not u.hostname:
            return f"--target wants ROLE=URL with ROLE one of {', '.join(ROLES)} and an http(s) URL, got {item!r}"
    return None


def run(args: argparse.Namespace) -> int:
    if wrong := problem(args):
        print(f"slofleet autoscaler: {wrong}", file=sys.stderr)
        return 2
    base = PolicyConfig(prefill_tps=args.prefill_tps, decode_tps=args.decode_tps, cold_start_s=args.cold_start)
    if args.kubernetes:
        from . import kubemode
        from .kube import Kube, connect
        return kubemode.run(Kube(connect()), base, args.namespace, args.prometheus, args.resync, args.iterations,
                            args.status_window)
    if args.prometheus:
        print("slofleet autoscaler: --prometheus needs --kubernetes (the series are found by the resource's "
              "namespace and Service)", file=sys.stderr)
        return 2
    return run_targets(args, base)


def run_targets(args: argparse.Namespace, base: PolicyConfig) -> int:
    targets: dict[str, list[str]] = {}
    for item in args.target:
        role, _, url = item.partition("=")
        targets.setdefault(role, []).append(url)
    if not targets:
        print("slofleet autoscaler: give --kubernetes or at least one --target ROLE=URL", file=sys.stderr)
        return 2
    slo = SLO(args.ttft, args.tpot)
    policies = {role: Policy(PolicyConfig(role=role, slo=slo, min_replicas=args.min_replicas,
                                          max_replicas=args.max_replicas, prefill_tps=base.prefill_tps,
                                          decode_tps=base.decode_tps, cold_start_s=base.cold_start_s,
                                          stale_after_s=STALE_INTERVALS * args.interval))
                for role in targets}
    history = {role: History(args.window) for role in targets}
    n = 0
    while not args.iterations or n < args.iterations:
        now = time.time()
        for role, urls in targets.items():
            pods = [s for s in (scrape(u, role, args.interval / 2) for u in urls) if s is not None]
            if pods:
                history[role].add(merge(role, now, pods))
            win = history[role].window(now, {DEFAULT_BUCKET: (slo.ttft_s, slo.tpot_s)})
            d = policies[role].decide(now, win, Fleet(ready=len(pods)))
            print(json.dumps({"time": round(now, 1), "role": role, "ready": len(pods), "desired": d.desired,
                              "condition": d.condition, "reason": d.reason}), flush=True)
        n += 1
        if not args.iterations or n < args.iterations:
            time.sleep(max(0.0, args.interval - (time.time() - now)))
    return 0
