"""Pure: the engines' per-bucket latency histograms over a window -> status.buckets, each bucket's SLO attainment.

An engine's histograms are cumulative since it started, so a window is, pod by pod, its newest scrape minus its
oldest one within the window, summed over pods. A pod first seen that started within the window counts from zero,
so requests it served before its first scrape are not lost to a baseline (a bucket's first requests show at the
next scrape however few they are); a pod gone keeps its requests until they leave the window.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from slofleet.api.v1alpha1 import Bucket, BucketStatus

from .admissions import Admissions
from .diagnose import shares
from .signals import HISTOGRAMS, Histogram, RoleSignals

STATUS_WINDOW_S = 300.0  # what each attainment covers, by default (`slofleet autoscaler --status-window`)
KINDS = tuple(HISTOGRAMS.values())  # ttft, itl, e2e
# status field -> (histogram, the SLO's target field); TPOT is read from the inter-token latency.
TARGETS = {"ttft_ms": ("ttft", "ttft_ms"), "tpot_ms": ("itl", "tpot_ms"), "e2e_ms": ("e2e", "e2e_ms")}
Hists = dict[str, dict[str, Histogram]]  # kind -> bucket -> histogram


@dataclass
class Observed:
    """The scrapes of one service's client-facing pods over the last `window_s` seconds, by pod name."""
    window_s: float
    pods: dict[str, list[RoleSignals]] = field(default_factory=dict)

    def add(self, sig: RoleSignals, started: float | None = None) -> None:
        seen = self.pods.get(sig.pod)
        if seen is None:
            zero = started is not None and started >= sig.t - self.window_s
            seen = self.pods[sig.pod] = [RoleSignals(sig.role, started)] if zero else []
        if not seen or sig.t > seen[-1].t:
            seen.append(sig)

    def delta(self, now: float) -> Hists:
        out: Hists = {k: {} for k in KINDS}
        for pod in list(self.pods):
            seen = self.pods[pod] = [s for s in self.pods[pod] if s.t >= now - self.window_s]
            if not seen:  # gone (or unanswered) for a whole window
                del self.pods[pod]
                continue
            old, new = seen[0], seen[-1]
            for kind in KINDS:
                for bucket, h in getattr(new, kind).items():
                    d = h.minus(getattr(old, kind).get(bucket))
                    if bucket not in out[kind]:
                        out[kind][bucket] = d
                    elif d.bounds == out[kind][bucket].bounds:  # an engine of other bounds (mid-upgrade) is left out
                        out[kind][bucket] = out[kind][bucket].plus(d)
        return out

    def phase_means(self) -> dict[str, dict[str, float]]:
        """bucket -> phase -> mean seconds over the window (call after `delta`, which drops what left it)."""
        sums: dict[tuple[str, str, str], float] = {}
        for seen in self.pods.values():
            old, new = seen[0], seen[-1]
            for key, v in new.phases.items():
                d = v - old.phases.get(key, 0.0)
                sums[key] = sums.get(key, 0.0) + (v if d < 0 else d)  # a restart counts from zero
        out: dict[str, dict[str, float]] = {}
        for (phase, bucket, part), count in sums.items():
            if part == "count" and count > 0:
                out.setdefault(bucket, {})[phase] = sums.get((phase, bucket, "sum"), 0.0) / count
        return out


def dominant(clock: str, means: dict[str, float]) -> str:
    """The phase holding most of the slow clock's mean, by `slofleet diagnose`'s rule (engine-side phases)."""
    share = shares(clock, {k: means.get(k, 0.0) for k in ("queue", "prefill", "decode", "ttft", "e2e")}, None, None)
    return max(share, key=share.get)


def bucket_status(b: Bucket, hists: Hists, window_s: float, when: str,
                  means: dict[str, float] | None = None, counted: Admissions | None = None) -> BucketStatus:
    """One bucket's entry: requests finished in the window, and for each target it sets the share within it and
    the latency at the bucket's own percentile. Met when the least-met target's share reaches the percentile."""
    got = {kind: hists.get(kind, {}).get(b.name) for kind in KINDS}
    requests = next((h.total for h in (got["e2e"], got["ttft"]) if h is not None and h.total), 0.0)
    q = b.slo.percentile / 100
    figures: dict = {}
    within: dict[str, float] = {}  # clock -> share of requests within its target
    for name, (kind, target) in TARGETS.items():
        h, ms = got[kind], getattr(b.slo, target)
        if ms is None or h is None or h.total <= 0 or not requests:  # e.g. no ITL when every output is 1 token
            continue
        within[name.removesuffix("_ms")] = h.fraction_le(ms / 1000)
        figures[name] = round(h.quantile(q) * 1000, 1)
    if within:
        worst = min(within, key=within.get)
        figures |= {"attainment": round(within[worst], 4), "met": within[worst] >= q}
        if within[worst] < q and means:
            figures["dominant"] = dominant(worst, means)
    if counted is not None:  # the routers' admission in the window
        figures |= {"admitted": round(counted.admitted.get(b.name, 0.0)),
                    "refused": {r: round(n) for r, n in counted.refused.get(b.name, {}).items() if round(n)}}
    return BucketStatus(name=b.name, window_seconds=round(window_s), requests=round(requests),
                        percentile=b.slo.percentile, time=when, **figures)


def status_patch(entries: list[BucketStatus]) -> dict:
    """A merge patch of status.buckets (the whole list: the autoscaler is its one writer) and the worst attainment
    (null removes it when no bucket had requests). The operator's fields are left alone."""
    judged = [e.attainment for e in entries if e.attainment is not None]
    return {"status": {"buckets": [e.wire() for e in entries], "attainment": min(judged) if judged else None}}


def same(a: list[BucketStatus] | None, b: list[BucketStatus]) -> bool:
    """Nothing worth a write: the figures are those written before (only the time moved)."""
    return a is not None and [e.model_copy(update={"time": None}) for e in a] == \
        [e.model_copy(update={"time": None}) for e in b]
