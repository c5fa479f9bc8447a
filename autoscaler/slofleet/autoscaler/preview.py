"""`slofleet simulate --llmservice FILE.yaml`: what an LLMService would get and cost on a trace before it is applied
(per-bucket attainment, replica-hours, cost, replicas over the day), and with `--compare NEW.yaml` what a proposed
change would, on the same requests, side by side.

The fleet is the resource's: its buckets and their SLOs, its bounds and autoscaling settings turned into the
policy's configuration by the same code the autoscaler runs in the cluster (actuate.settings), or its fixed count
when autoscaling is off. Trace requests fall into buckets as the router classifies them (slofleet.router.buckets:
the first bucket whose match holds, else the catch-all): prompt tokens as the trace records them, max_tokens as the
tokens it generated, the route /v1/chat/completions for the conversation traces (conversation, long) and
/v1/completions for code, no headers. A bucket without an SLO is served but judged on no target.
"""
from __future__ import annotations

import argparse
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import yaml
from pydantic import ValidationError

from slofleet.api.base import error_text
from slofleet.api.contract import UNIFIED
from slofleet.api.v1alpha1 import LLMService
from slofleet.router.buckets import Classifier, parse_buckets

from . import actuate, profiles, simulate_cli, traces
from .baselines import Static
from .policy import SLO, Policy
from .sim import Result, SimConfig, simulate

ROUTES = {"conversation": "/v1/chat/completions", "long": "/v1/chat/completions", "code": "/v1/completions"}
PEAK_SHARE, MEAN_SHARE = 0.75, 0.5  # default load: a day's busiest minute, a replay's mean, in maxReplicas


def load_service(path: str) -> LLMService:
    """The one LLMService of a YAML file (documents of other kinds beside it, as in a bundle, are passed over)."""
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML: {' '.join(str(e).split())}") from None
    found = [d for d in docs if isinstance(d, dict) and d.get("kind", "LLMService") == "LLMService"]
    if len(found) != 1:
        kinds = sorted({str(d.get("kind")) for d in docs if isinstance(d, dict)})
        raise ValueError(f"{path}: {len(found)} LLMService documents (kinds in it: {', '.join(kinds) or 'none'}); "
                         "give a file with one")
    try:
        svc = LLMService.model_validate(found[0])
    except ValidationError as e:
        raise ValueError(f"{path}: not a valid LLMService: {error_text(e)}") from None
    if svc.spec.topology.mode != UNIFIED:
        raise ValueError(f"{path}: the fleet simulator models unified replicas; topology.mode is "
                         f"{svc.spec.topology.mode}")
    if svc.spec.topology.pools()[UNIFIED].max_replicas < 1:
        raise ValueError(f"{path}: topology.unified.maxReplicas is 0; the fleet simulator needs at least one replica")
    if svc.spec.policy_ref and not svc.spec.buckets:
        raise ValueError(f"{path}: spec.policyRef names an SLOPolicy; give its buckets inline to preview them")
    return svc


def targets(svc: LLMService) -> tuple[list, dict[str, SLO]]:
    """The router's buckets (a catch-all added when none is one) and each one's targets (none: infinite)."""
    routed = parse_buckets([b.model_dump(by_alias=True, exclude_none=True) for b in svc.spec.buckets])
    judged = actuate.bucket_slos([b for b in routed if b.slo is not None])
    return routed, {b.name: judged.get(b.name, SLO(math.inf, math.inf, 0.0)) for b in routed}


def classify(trace: traces.Trace, routed: list) -> np.ndarray:
    """Each request's bucket index, classified once per distinct (prompt, output) pair."""
    route, rules = ROUTES[trace.name.removesuffix("-day")], Classifier(routed)
    pairs, inverse = np.unique(np.stack([trace.prompt, trace.output]), axis=1, return_inverse=True)
    index = {b.name: i for i, b in enumerate(routed)}
    picked = [index[rules.classify(int(p), int(o), {}, route).name] for p, o in pairs.T]
    return np.asarray(picked, np.int64)[inverse.ravel()]


def load_args(args: argparse.Namespace, svc: LLMService) -> argparse.Namespace:
    """The trace's size: given, else sized to the current spec's maxReplicas."""
    top = svc.spec.topology.pools()[UNIFIED].max_replicas
    return argparse.Namespace(**{**vars(args), "peak_replicas": args.peak_replicas or PEAK_SHARE * top,
                                 "replay_replicas": args.replay_replicas or MEAN_SHARE * top})


def run_spec(job: tuple) -> tuple[Result, dict[str, float]]:
    """One spec on one trace: its prediction, and each bucket's share of the requests."""
    path, label, name, args = job
    svc, prof = load_service(path), profiles.load(args.profile)
    trace, _ = simulate_cli.scenario(name, prof, args)
    routed, slos = targets(svc)
    trace = traces.Trace(trace.name, trace.arrival, trace.prompt, trace.output, classify(trace, routed))
    shares = np.bincount(trace.bucket, minlength=len(routed)) / max(len(trace.arrival), 1)
    pool, auto = svc.spec.topology.pools()[UNIFIED], svc.spec.autoscaling
    rs = actuate.settings(svc, [b for b in routed if b.slo is not None],
                          simulate_cli.base_config(prof, SLO(), pool.max_replicas))[UNIFIED]
    fixed = pool.replicas if pool.replicas is not None else pool.min_replicas
    if auto.enabled:
        ctrl, start = Policy(rs.policy), min(max(simulate_cli.initial(trace, prof, rs.policy.slo),
                                                 pool.min_replicas), pool.max_replicas)
    else:
        ctrl, start = Static(fixed), fixed
    cfg = SimConfig(prof, rs.policy.slo, initial=start, dt=1.0 if trace.duration > 7200 else 0.5,
                    decide_s=auto.interval_seconds, window_s=rs.window_s, buckets=slos)
    return simulate(trace, ctrl, cfg, label), dict(zip(slos, shares.tolist()))


def fleet(svc: LLMService) -> str:
    pool, auto = svc.spec.topology.pools()[UNIFIED], svc.spec.autoscaling
    if auto.enabled:
        return f"autoscaled, {pool.min_replicas}-{pool.max_replicas} replicas"
    return f"autoscaling off: {pool.replicas if pool.replicas is not None else pool.min_replicas} replicas"


def slo_text(s: SLO) -> str:
    parts = [f"{k} {v * 1e3:.0f}ms" for k, v in (("TTFT", s.ttft_s), ("TPOT", s.tpot_s), ("E2E", s.e2e_s))
             if math.isfinite(v)]
    return f"p{s.target * 100:g} {' '.join(parts)}"


def run(args: argparse.Namespace) -> int:
    paths = [args.llmservice] + ([args.compare] if args.compare else [])
    try:
        specs = [load_service(p) for p in paths]
    except (OSError, ValueError) as e:
        print(f"slofleet simulate: cannot preview: {e}", file=sys.stderr)
        return 2
    args = load_args(args, specs[0])  # the same requests for both: sized by the current spec
    prof, labels = profiles.load(args.profile), ["current", "proposed"][:len(paths)]
    results: dict[str, list[Result]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for name in [t for t in args.traces.split(",") if t]:
            trace, _ = simulate_cli.scenario(name, prof, args)
            size = (f"busiest minute needs {args.peak_replicas:g}" if name.endswith("-day") else
                    f"mean needs {args.replay_replicas:g}")
            print(f"\n{name}: {len(trace.arrival):,} requests over {trace.duration / 3600:.2f} h, sized so its "
                  f"{size} replicas at full capacity; profile {prof.name}")
            got = list(pool.map(run_spec, [(p, lab, name, args) for p, lab in zip(paths, labels)]))
            results[name] = [r for r, _ in got]
            table(paths, specs, got, args)
    if args.png:
        simulate_cli.plot(results, args.png)
        print(f"\nwrote {args.png}")
    return 0


def table(paths: list[str], specs: list[LLMService], got: list[tuple[Result, dict[str, float]]],
          args: argparse.Namespace) -> None:
    """One column per spec: its fleet, each bucket's predicted attainment against its own SLO, the cost."""
    names = list(dict.fromkeys(b for s in specs for b in targets(s)[1]))
    cells = []
    for path, svc, (r, share) in zip(paths, specs, got):
        slos, col = targets(svc)[1], [Path(path).name, fleet(svc)]
        for b in names:
            s = slos.get(b)
            if s is None or s.target <= 0:  # not this spec's bucket, or one without an SLO
                col.append("-" if s is None else f"no SLO, {share[b]:.0%} of requests")
                continue
            verdict = "met" if r.buckets[b] >= s.target else "missed"
            col.append(f"{r.buckets[b]:.1%} ({slo_text(s)}: {verdict}), {share[b]:.0%} of requests")
        price = args.price_per_hour if args.price_per_hour is not None else svc.spec.engine.price_per_hour
        col += [f"{r.replica_hours:.1f}", f"{r.replica_hours * price:,.2f} at {price:g}/h" if price else "-",
                f"{r.replicas.min():.0f}-{r.replicas.max():.0f}, mean {r.replicas.mean():.1f}"]
        cells.append(col)
    rows = ["", "fleet", *[f"bucket {b}" for b in names], "replica-hours", "cost", "replicas (paid)"]
    width = max(len(c) for col in cells for c in col) + 2
    for i, row in enumerate(rows):
        print(f"{row:<16}" + "".join(f"{col[i]:<{width}}" for col in cells).rstrip(), flush=True)
