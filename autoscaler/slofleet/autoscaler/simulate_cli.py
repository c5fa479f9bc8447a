"""`slofleet simulate`: every policy on every trace through the fleet simulator; a table and a PNG.

Real traces are replayed at real time, time-shifted copies overlaid so their mean load needs `--replay-replicas`
replicas (`--replay speed`: the trace alone, time-scaled to that load); synthesized days are scaled so their peak
needs about `--peak-replicas`. Static peak is the smallest constant count that reaches the attainment target on the
same trace (found by bisection).
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from . import profiles, traces
from .baselines import HPA, HPABehavior, KEDAQueue, Oracle, Static, Thresholds
from .policy import SLO, Policy, PolicyConfig
from .sim import Result, SimConfig, simulate

POLICIES = ("slofleet", "static-peak", "hpa", "keda-queue", "thresholds", "oracle")
TRACES = ("conversation", "code", "long", "conversation-day", "code-day")
REPLAYS = ("overlay", "speed")
# GPU (TTFT s, TPOT s) per trace kind: long prompts get a longer TTFT target. Other profiles get targets
# scaled from their own speed (4x a lone mean request), as a CPU replica is orders of magnitude slower.
GPU_SLOS = {"long": (2.0, 0.05), "*": (0.5, 0.05)}
REF_MIX = (1000.0, 200.0)  # the mix the policy's capacity priors are computed for (it prices each mix by the profile)
# Each baseline's main parameter, tuned as its users would: `--sweep` tries these values on a trace, and the one it
# chose on conversation-day (the cheapest reaching the target, else the most SLO-meeting requests per replica-hour)
# is what every other run uses unless one is given (hpa:0.9). keda-queue's queue is empty whenever the fleet keeps
# up, so it scales to its minimum and back at any threshold; a high one at least keeps it under static peak's cost.
SWEEP = {"hpa": (0.5, 0.6, 0.7, 0.8, 0.9), "keda-queue": (1.0, 5.0, 20.0, 100.0, 500.0),
         "thresholds": (0.1, 0.15, 0.2, 0.3, 0.5, 0.85)}
TUNED = {"hpa": 0.8, "keda-queue": 500.0, "thresholds": 0.15}
SETTING = {"hpa": "target={:g}", "keda-queue": "threshold={:g}", "thresholds": "kv_up={:g}"}  # the main parameter


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces", default="conversation,code,long,conversation-day", help=f"any of {','.join(TRACES)}")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"any of {','.join(POLICIES)}; hpa:0.9 or keda-queue:2 set the baseline's target")
    p.add_argument("--profile", "--replica-profile", dest="profile", default="gpu",
                   help="replica profile: gpu (published H100 figures), cpu (measured here) or a JSON path")
    p.add_argument("--ttft", type=float, help="TTFT target in seconds (default: per trace and profile)")
    p.add_argument("--tpot", type=float, help="TPOT target in seconds (default: per trace and profile)")
    p.add_argument("--target", type=float, default=SLO.target, help="attainment target")
    p.add_argument("--peak-replicas", type=float, help="synthesized days need about this many at peak (default 20; "
                   "with --llmservice 3/4 of its maxReplicas)")
    p.add_argument("--replay-replicas", type=float, help="real traces need about this many at mean (default 2; with "
                   "--llmservice half its maxReplicas)")
    p.add_argument("--replay", choices=REPLAYS, default="overlay",
                   help="how a real trace gets its load: overlay (real time, time-shifted copies added; default) or "
                        "speed (the trace alone, played faster or slower)")
    p.add_argument("--hours", type=float, default=24.0, help="length of a synthesized day")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="processes running simulations")
    p.add_argument("--png", default="simulate.png", help="replicas and attainment over time ('' for none)")
    p.add_argument("--reasons", action="store_true", help="print slofleet's scaling decisions and reasons")
    p.add_argument("--llmservice", metavar="FILE.yaml",
                   help="predict this LLMService on --traces: per-bucket attainment, replica-hours, cost, replicas")
    p.add_argument("--compare", metavar="NEW.yaml", help="with --llmservice: a proposed spec, predicted beside it")
    p.add_argument("--price-per-hour", type=float, help="with --llmservice: one replica's price (default: the "
                   "spec's engine.pricePerHour)")
    p.add_argument("--sweep", action="store_true",
                   help="try each baseline's main parameter over a few values (SWEEP) and mark the best")


def scenario(name: str, prof: profiles.Profile, args: argparse.Namespace) -> tuple[traces.Trace, SLO]:
    return build(name, prof, args.ttft, args.tpot, args.target, args.peak_replicas, args.replay_replicas,
                 args.hours, args.seed, args.replay)


@functools.lru_cache(maxsize=4)  # a day takes seconds to synthesize; each worker reuses it across policies
def build(name: str, prof: profiles.Profile, ttft_s: float | None, tpot_s: float | None, target: float,
          peak_replicas: float, replay_replicas: float, hours: float, seed: int,
          replay: str = "overlay") -> tuple[traces.Trace, SLO]:
    kind = name.removesuffix("-day")
    base = traces.load(kind)
    p, o = float(base.prompt.mean()), float(base.output.mean())
    if prof.name.startswith("gpu"):
        ttft, tpot = GPU_SLOS.get(kind, GPU_SLOS["*"])
    else:
        ttft = 4 * prof.prefill_alone_s(p)
        tpot = 4 * (prof.step_s + prof.decode_seq_s + prof.kv_token_s * (p + o / 2))
    slo = SLO(ttft_s or ttft, tpot_s or tpot, target)
    cap = prof.capacity(p, o, slo.tpot_s)
    if name.endswith("-day"):
        return traces.synth_day(base, peak_replicas * cap, hours, seed=seed), slo
    factor = replay_replicas * cap / base.rate
    if replay == "overlay" and factor > 1:  # never faster than real time: more load is more users
        return traces.overlay(base, factor, seed), slo
    return traces.scale(base, factor), slo


def resolve(policy: str) -> tuple[str, float | None]:
    """'hpa:0.9' -> ('hpa', 0.9); a baseline without a value gets its tuned one."""
    name, _, arg = policy.partition(":")
    return name, float(arg) if arg else TUNED.get(name)


def setting(policy: str) -> str:
    name, value = resolve(policy)
    if name == "slofleet":
        return f"aim={PolicyConfig.aim:g}"
    return SETTING[name].format(value) if name in SETTING else "-"


def base_config(prof: profiles.Profile, slo: SLO, hi: int) -> PolicyConfig:
    pre, dec = prof.rates(*REF_MIX, slo.tpot_s)
    return PolicyConfig(slo=slo, max_replicas=hi, prefill_tps=pre, decode_tps=dec, profile=prof,
                        cold_start_s=prof.cold_start_s)


def controller(policy: str, trace: traces.Trace, prof: profiles.Profile, slo: SLO, n: int, hi: int):
    policy, value = resolve(policy)
    if policy == "slofleet":
        return Policy(base_config(prof, slo, hi))
    if policy == "hpa":
        return HPA(prof, slo.tpot_s, value, HPABehavior(max_replicas=hi))
    if policy == "keda-queue":
        return KEDAQueue(value, HPABehavior(max_replicas=hi))
    if policy == "thresholds":
        return Thresholds(kv_up=value, kv_down=value / 2, max_replicas=hi)
    if policy == "oracle":
        return Oracle(trace, prof, slo.tpot_s, max_replicas=hi)
    return Static(n)


def run_one(job: tuple) -> Result:
    policy, name, args, n = job
    prof = profiles.load(args.profile)
    trace, slo = scenario(name, prof, args)
    hi = bounds(trace, prof, slo)
    ctrl = controller(policy, trace, prof, slo, n, hi)
    start = n if policy == "static-peak" else initial(trace, prof, slo)
    dt = 1.0 if trace.duration > 7200 else 0.5  # day-long runs: 1 s ticks agree with 0.25 s within 0.1%
    return simulate(trace, ctrl, SimConfig(prof, slo, initial=start, dt=dt), policy)


def bounds(trace: traces.Trace, prof: profiles.Profile, slo: SLO) -> int:
    """maxReplicas for every policy: three times the busiest minute's need at full capacity."""
    return max(4, 3 * int(Oracle(trace, prof, slo.tpot_s, utilization=1.0).need.max()))


def initial(trace: traces.Trace, prof: profiles.Profile, slo: SLO) -> int:
    """Every autoscaled fleet starts sized for the first minutes, as if it had been running."""
    return max(1, int(Oracle(trace, prof, slo.tpot_s).need[:5].max()))


def static_peak(name: str, args: argparse.Namespace, pool: ProcessPoolExecutor) -> Result:
    """Smallest constant count reaching the target, by bisection (two probes at a time, one per worker)."""
    prof = profiles.load(args.profile)
    trace, slo = scenario(name, prof, args)
    lo, hi = 0, bounds(trace, prof, slo)  # lo fails, hi is assumed to pass
    found: dict[int, Result] = {}
    while hi - lo > 1:
        probes = sorted({lo + (hi - lo) // 3 or lo + 1, lo + 2 * (hi - lo) // 3 or lo + 1} - {lo, hi})
        for n, r in zip(probes, pool.map(run_one, [("static-peak", name, args, n) for n in probes])):
            found[n] = r
        ok = [n for n in probes if found[n].attainment >= args.target]
        bad = [n for n in probes if found[n].attainment < args.target]
        hi, lo = (min(ok) if ok else hi), (max(bad) if bad else lo)
    return found.get(hi) or run_one(("static-peak", name, args, hi))


def problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in one line, or None."""
    names = [t for t in args.traces.split(",") if t]
    policies = [p for p in args.policies.split(",") if p]
    unknown = [x for x in names if x not in TRACES] + [x for x in policies if x.partition(":")[0] not in POLICIES]
    if unknown or not names:
        return f"unknown trace or policy: {', '.join(unknown) or '(no trace)'}; traces: {', '.join(TRACES)}"
    if args.compare and not args.llmservice:
        return "--compare needs --llmservice (the current spec it is compared with)"
    for flag, value in (("--ttft", args.ttft), ("--tpot", args.tpot), ("--peak-replicas", args.peak_replicas),
                        ("--replay-replicas", args.replay_replicas), ("--hours", args.hours)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            return f"{flag} must be a number above 0, got {value:g}"
    if not 0 < args.target <= 1:
        return f"--target is the share of requests to meet the SLO, above 0 and at most 1, got {args.target:g}"
    if args.price_per_hour is not None and not (args.price_per_hour >= 0 and math.isfinite(args.price_per_hour)):
        return f"--price-per-hour must be 0 or more, got {args.price_per_hour:g}"
    if args.png and not Path(args.png).resolve().parent.is_dir():
        return f"--png {args.png}: its folder does not exist"
    if args.jobs < 1:
        return f"--jobs must be at least 1, got {args.jobs}"
    try:
        profiles.load(args.profile)
    except (OSError, ValueError, TypeError) as e:
        return f"--replica-profile {args.profile}: cannot load it ({e}); give gpu, cpu or a profile JSON file"
    return None


def run(args: argparse.Namespace) -> int:
    if wrong := problem(args):
        print(f"slofleet simulate: {wrong}", file=sys.stderr)
        return 2
    if args.llmservice:
        from . import preview
        return preview.run(args)
    args = argparse.Namespace(**{**vars(args), "peak_replicas": args.peak_replicas or 20.0,
                                 "replay_replicas": args.replay_replicas or 2.0})
    names = [t for t in args.traces.split(",") if t]
    policies = [p for p in args.policies.split(",") if p]
    prof = profiles.load(args.profile)
    print(f"profile {prof.name}: {prof.source}")
    results: dict[str, list[Result]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for name in names:
            trace, slo = scenario(name, prof, args)
            print(f"\n{name}: {len(trace.arrival):,} requests over {trace.duration / 3600:.2f} h, "
                  f"{trace.rate:.1f} req/s mean; SLO TTFT {slo.ttft_s * 1e3:.0f} ms, TPOT {slo.tpot_s * 1e3:.0f} ms, "
                  f"target {slo.target:.0%} of requests meeting both", flush=True)
            if args.sweep:
                sweep(name, policies, args, pool)
                continue
            dynamic = [p for p in policies if p != "static-peak"]
            rs = list(pool.map(run_one, [(p, name, args, 0) for p in dynamic]))
            if "static-peak" in policies:
                rs.insert(0, static_peak(name, args, pool))
            results[name] = rs
            table(rs)
            if rs[0].policy == "static-peak" and rs[0].attainment < args.target:
                print(f"(no constant count up to {max(rs[0].replicas):.0f} reaches {args.target:.0%}: "
                      "static peak is that bound)")
            if args.reasons:
                for r in rs:
                    if r.policy == "slofleet":
                        print("\n".join(r.reasons))
    if args.png and results:
        plot(results, args.png)
        print(f"\nwrote {args.png}")
    return 0


def table(rs: list[Result], mark: Result | None = None) -> None:
    """The first four columns (policy, attain, rep-h, vs static) and the row labels are what scripts read."""
    static = next((r.replica_hours for r in rs if r.policy == "static-peak"), None)
    print(f"{'policy':<12} {'attain':>7} {'rep-h':>8} {'vs static':>9} {'good/rep-h':>10} {'actions':>7} "
          f"{'TTFT p50':>9} {'TPOT p50':>9} {'preempt':>7}  setting")
    for r in rs:
        rel = f"{r.replica_hours / static:.0%}" if static else "-"
        label = f"static-{max(r.replicas):.0f}" if r.policy == "static-peak" else resolve(r.policy)[0]
        print(f"{label:<12} {r.attainment:>7.1%} {r.replica_hours:>8.1f} {rel:>9} {r.goodput_per_rh:>10,.0f} "
              f"{r.actions:>7} {r.ttft_p50 * 1e3:>7.0f}ms {r.tpot_p50 * 1e3:>7.1f}ms {r.preemptions:>7}  "
              f"{setting(r.policy)}{'  <- best' if r is mark else ''}", flush=True)


def best(rs: list[Result], target: float) -> Result:
    """The cheapest setting reaching the target; when none does, the most SLO-meeting requests per replica-hour."""
    ok = [r for r in rs if r.attainment >= target]
    return min(ok, key=lambda r: r.replica_hours) if ok else max(rs, key=lambda r: r.goodput_per_rh)


def sweep(name: str, policies: list[str], args: argparse.Namespace, pool: ProcessPoolExecutor) -> None:
    """Each baseline's main parameter over SWEEP on one trace, beside static peak; the best one marked."""
    static = static_peak(name, args, pool)
    for policy in [p for p in SWEEP if p in policies]:
        rs = list(pool.map(run_one, [(f"{policy}:{v:g}", name, args, 0) for v in SWEEP[policy]]))
        print(f"sweep of {policy} over its {SETTING[policy].split('=')[0]}:")
        table([static, *rs], best(rs, args.target))


def plot(results: dict[str, list[Result]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 2, figsize=(14, 3.2 * len(results)), squeeze=False)
    for row, (name, rs) in zip(axes, results.items()):
        for r in rs:
            hours = r.t / 3600
            row[0].plot(hours, r.replicas, label=r.policy, lw=1)
            smooth = rolling(r.attained, 15 if len(r.t) > 300 else 1)
            row[1].plot(hours, smooth, label=r.policy, lw=1)
        row[0].set_title(f"{name}: replicas (paid)")
        row[1].set_title(f"{name}: SLO attainment by arrival minute")
        row[1].set_ylim(0, 1.02)
        for ax in row:
            ax.set_xlabel("hours")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def rolling(x, n: int):
    import numpy as np
    if n <= 1:
        return x
    ok = np.isfinite(x)
    num = np.convolve(np.where(ok, x, 0.0), np.ones(n), mode="same")
    den = np.convolve(ok.astype(float), np.ones(n), mode="same")
    return np.where(den > 0, num / np.maximum(den, 1), math.nan)
