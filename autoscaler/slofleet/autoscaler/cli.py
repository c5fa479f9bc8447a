"""`slofleet autoscaler`: scrape engine /metrics per role, decide, and print each decision as a JSON line.

Pods are given as URLs here (`--target prefill=http://10.0.0.7:8000`); finding them through the Kubernetes
API and writing `status.autoscaling.<role>.desiredReplicas` belong to the operator side and are not wired
yet, so this loop only reports what it would ask for.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from .policy import SLO, Fleet, Policy, PolicyConfig
from .signals import RoleSignals, merge, parse, window


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", action="append", default=[], metavar="ROLE=URL",
                   help="an engine's base URL and its role (unified, prefill, decode); repeat per pod")
    p.add_argument("--ttft", type=float, default=0.5, help="TTFT target, seconds")
    p.add_argument("--tpot", type=float, default=0.05, help="TPOT target, seconds")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=16)
    p.add_argument("--prefill-tps", type=float, default=20_000.0, help="prior: prompt tokens/s per replica")
    p.add_argument("--decode-tps", type=float, default=4_000.0, help="prior: generated tokens/s per replica")
    p.add_argument("--cold-start", type=float, default=90.0, help="seconds from asking for a replica to its serving")
    p.add_argument("--interval", type=float, default=15.0, help="seconds between scrapes and decisions")
    p.add_argument("--window", type=float, default=60.0, help="seconds of history each decision reads")
    p.add_argument("--iterations", type=int, default=0, help="stop after this many decisions (0: run forever)")


def scrape(url: str, role: str, timeout: float) -> RoleSignals | None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
            return parse(r.read().decode(), role, time.time())
    except (OSError, ValueError) as e:  # an unreachable pod is missing data, not zero load
        print(json.dumps({"scrape_error": url, "error": str(e)}), file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    targets: dict[str, list[str]] = {}
    for item in args.target:
        role, _, url = item.partition("=")
        if not url:
            print(f"--target wants ROLE=URL, got {item!r}", file=sys.stderr)
            return 2
        targets.setdefault(role, []).append(url)
    slo = SLO(args.ttft, args.tpot)
    policies = {role: Policy(PolicyConfig(role=role, slo=slo, min_replicas=args.min_replicas,
                                          max_replicas=args.max_replicas, prefill_tps=args.prefill_tps,
                                          decode_tps=args.decode_tps, cold_start_s=args.cold_start,
                                          stale_after_s=3 * args.interval))
                for role in targets}
    history: dict[str, list[RoleSignals]] = {role: [] for role in targets}
    n = 0
    while not args.iterations or n < args.iterations:
        now = time.time()
        for role, urls in targets.items():
            pods = [s for s in (scrape(u, role, args.interval / 2) for u in urls) if s is not None]
            if pods:
                history[role] = [s for s in history[role] if s.t >= now - 2 * args.window] + [merge(role, now, pods)]
            seen = history[role]
            old = next((s for s in seen if s.t >= now - args.window), None)
            win = window(old, seen[-1], {"default": (slo.ttft_s, slo.tpot_s)}) if old and old is not seen[-1] else None
            d = policies[role].decide(now, win, Fleet(ready=len(pods)))
            print(json.dumps({"time": round(now, 1), "role": role, "ready": len(pods), "desired": d.desired,
                              "condition": d.condition, "reason": d.reason}), flush=True)
        n += 1
        if not args.iterations or n < args.iterations:
            time.sleep(max(0.0, args.interval - (time.time() - now)))
    return 0
