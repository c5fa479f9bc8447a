"""Engine `/metrics` (Prometheus text) -> per-role signals -> windowed rates and SLO attainment.

Counters and histograms are cumulative, so everything the policy reads about a window (arrival rate, mean
lengths, attainment) is the difference of two scrapes; gauges are read from the newer one.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from slofleet.api.contract import (
    DEFAULT_BUCKET,
    QUEUED_PROMPT_TOKENS,
    ROUTER,
    ROUTER_E2E,
    ROUTER_TPOT,
    ROUTER_TTFT,
    RUNTIME_METRICS,
    SLOFLEET,
    Sample,
    parse_samples,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Names:
    """The series a pod's scrape is read by, each mapped to the RoleSignals field it fills."""
    gauges: dict[str, str]
    counters: dict[str, str]  # by their exposed name (base name + `_total`)
    histograms: dict[str, str]  # per bucket: the SLO clocks
    phases: dict[str, str]  # histograms whose sum and count per bucket give each phase's mean


@functools.cache
def names(runtime: str) -> Names:
    """An engine's names from contract.RUNTIME_METRICS (what a runtime does not export is simply not read)."""
    rm = RUNTIME_METRICS[runtime]
    pick = lambda pairs: {series: field for field, series in pairs if series}  # noqa: E731
    gauges = pick([("waiting", rm.waiting), ("running", rm.running), ("kv_usage", rm.kv_usage)])
    if runtime == SLOFLEET:
        gauges[QUEUED_PROMPT_TOKENS] = "queued_prompt_tokens"
    counters = {f"{k}_total": v for k, v in pick([
        ("preemptions", rm.preemptions), ("prompt_tokens", rm.prompt_tokens),
        ("generation_tokens", rm.generation_tokens), ("finished", rm.finished)]).items()}
    return Names(gauges=gauges, counters=counters, histograms=pick([("ttft", rm.ttft), ("itl", rm.itl),
                                                                    ("e2e", rm.e2e)]),
                 phases=pick([("queue", rm.queue), ("prefill", rm.prefill), ("decode", rm.decode), ("ttft", rm.ttft),
                              ("e2e", rm.e2e)]))


ENGINE = names(SLOFLEET)
GAUGES, COUNTERS, HISTOGRAMS, PHASES = ENGINE.gauges, ENGINE.counters, ENGINE.histograms, ENGINE.phases
# A router's clocks: the same fields, timed where the client is (TPOT fills the inter-token field the policy reads)
ROUTER_NAMES = Names(gauges={}, counters={}, histograms={ROUTER_TTFT: "ttft", ROUTER_TPOT: "itl", ROUTER_E2E: "e2e"},
                     phases={})
BY_BUCKET = ("prompt_tokens", "generation_tokens")  # counters also kept per bucket label (each bucket's mix)


@dataclass(frozen=True)
class Histogram:
    bounds: tuple[float, ...]  # upper bounds ("le"), ascending, the last is +Inf
    counts: tuple[float, ...]  # cumulative counts per bound

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, old: Histogram | None) -> Histogram:
        if old is None or old.bounds != self.bounds or old.total > self.total:  # new pod or counter reset
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, old.counts)))

    def plus(self, other: Histogram) -> Histogram:
        if not self.counts:
            return other
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets cannot be summed")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)))

    def fraction_le(self, x: float) -> float | None:
        """Share of observations <= x, linear inside the bucket holding x (as histogram_quantile assumes)."""
        if self.total <= 0:
            return None
        lo, below = 0.0, 0.0
        for le, c in zip(self.bounds, self.counts):
            if x < le:
                if math.isinf(le):
                    return below / self.total
                return (below + (c - below) * (x - lo) / (le - lo)) / self.total
            lo, below = le, c
        return 1.0

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 < q < 1), linear inside its bucket; in the +Inf bucket the highest finite bound
        (both as histogram_quantile does)."""
        if self.total <= 0:
            return None
        rank, lo, below = q * self.total, 0.0, 0.0
        for le, c in zip(self.bounds, self.counts):
            if c >= rank:
                return lo if math.isinf(le) else lo + (le - lo) * (rank - below) / (c - below)
            lo, below = le, c
        return lo


@dataclass
class RoleSignals:
    """One role's metrics at one scrape, summed over its pods (kv_usage is their mean)."""
    role: str
    t: float  # scrape time, seconds
    pods: int = 0
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    queued_prompt_tokens: float = 0.0
    preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    finished: float = 0.0
    ttft: dict[str, Histogram] = field(default_factory=dict)  # per bucket
    itl: dict[str, Histogram] = field(default_factory=dict)
    e2e: dict[str, Histogram] = field(default_factory=dict)
    by_bucket: dict[str, dict[str, float]] = field(default_factory=dict)  # counter -> bucket -> value
    refused: dict[str, float] = field(default_factory=dict)  # bucket -> requests the routers refused (cumulative)
    phases: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (phase, bucket, "sum"|"count") -> value
    pod: str = ""  # which pod answered (one pod's signals; empty once merged)


def parse(text: str, role: str, t: float, runtime: str = SLOFLEET) -> RoleSignals:
    """One pod's /metrics text. Unknown metrics are ignored; labels other than `bucket` are summed over."""
    return from_samples(parse_samples(text), role, t, runtime=runtime)


def from_samples(samples: Iterable[Sample], role: str, t: float, pod: str = "",
                 runtime: str = SLOFLEET) -> RoleSignals:
    """One pod's parsed samples (as `parse`, for sources that group samples by pod themselves): an engine's by
    its runtime's names, a router's (role ROUTER) by its SLO clocks. An engine-wide phase (a runtime without a
    bucket label) is kept under the bucket ""."""
    sig = RoleSignals(role, t, pods=1, pod=pod)
    n = ROUTER_NAMES if role == ROUTER else names(runtime)
    buckets: dict[tuple[str, str], dict[float, float]] = {}
    for s in samples:
        if s.name in n.gauges or s.name in n.counters:
            attr = n.gauges.get(s.name) or n.counters[s.name]
            setattr(sig, attr, getattr(sig, attr) + s.value)
            if attr in BY_BUCKET and "bucket" in s.labels:
                counts = sig.by_bucket.setdefault(attr, {})
                counts[s.labels["bucket"]] = counts.get(s.labels["bucket"], 0.0) + s.value
        base, _, part = s.name.rpartition("_")
        if part in ("sum", "count") and base in n.phases:
            key3 = (n.phases[base], s.labels.get("bucket", ""), part)
            sig.phases[key3] = sig.phases.get(key3, 0.0) + s.value
        if s.name.endswith("_bucket") and s.name[:-7] in n.histograms:
            key = (n.histograms[s.name[:-7]], s.labels.get("bucket", DEFAULT_BUCKET))
            le = float(s.labels["le"])
            buckets.setdefault(key, {})[le] = buckets.get(key, {}).get(le, 0.0) + s.value
    for (kind, bucket), by_le in buckets.items():
        bounds = tuple(sorted(by_le))
        getattr(sig, kind)[bucket] = Histogram(bounds, tuple(by_le[b] for b in bounds))
    return sig


def merge(role: str, t: float, pods: list[RoleSignals]) -> RoleSignals:
    """Sum a role's pods into one RoleSignals; an empty list gives pods=0."""
    out = RoleSignals(role, t, pods=len(pods))
    for p in pods:
        for attr in list(GAUGES.values()) + list(COUNTERS.values()):
            setattr(out, attr, getattr(out, attr) + getattr(p, attr))
        for kind in HISTOGRAMS.values():
            hists = getattr(out, kind)
            for bucket, h in getattr(p, kind).items():
                hists[bucket] = hists[bucket].plus(h) if bucket in hists else h
        for attr, counts in p.by_bucket.items():
            mine = out.by_bucket.setdefault(attr, {})
            for bucket, v in counts.items():
                mine[bucket] = mine.get(bucket, 0.0) + v
        for bucket, v in p.refused.items():
            out.refused[bucket] = out.refused.get(bucket, 0.0) + v
    if pods:
        out.kv_usage /= len(pods)
    return out


@dataclass(frozen=True)
class BucketWindow:
    """One bucket's share of a window: what its requests ask for and how many of them met its targets."""
    requests: float  # first tokens in the window
    arrival_rate: float  # offered requests/s: the queue's growth shared by first tokens, plus the refused
    mean_prompt: float
    mean_output: float  # generated tokens per first token (a steady window's output length)
    ttft_attainment: float | None
    itl_attainment: float | None
    e2e_attainment: float | None = None  # where the bucket sets an E2E target


@dataclass
class Window:
    """What the policy reads about the last window: the newest gauges, plus rates and attainment."""
    now: RoleSignals
    seconds: float
    arrival_rate: float  # offered requests/s: first tokens emitted, growth of the queue, refused at admission
    mean_prompt: float | None
    mean_output: float | None
    prompt_rate: float  # prompt tokens computed per second
    output_rate: float  # tokens generated per second
    preemption_rate: float
    ttft_attainment: float | None  # worst bucket; None: no request finished a prefill in the window
    itl_attainment: float | None
    buckets: dict[str, BucketWindow] = field(default_factory=dict)  # the buckets with requests in the window
    refused_rate: float = 0.0  # requests/s refused at admission (in arrival_rate)


def window(old: RoleSignals, new: RoleSignals, slo: dict[str, tuple[float, ...]]) -> Window:
    """Rates and attainment between two scrapes; `slo` maps bucket -> (TTFT s, TPOT s[, E2E s]), infinite where
    there is no target. Buckets without an SLO use the 'default' one when there is one."""
    dt = max(new.t - old.t, 1e-9)
    delta = lambda attr: max(getattr(new, attr) - getattr(old, attr), 0.0)  # noqa: E731 (counter reset -> 0)
    firsts_by = {b: h.minus(old.ttft.get(b)).total for b, h in new.ttft.items()}
    firsts, finished = sum(firsts_by.values()), delta("finished")
    arrivals = max(firsts + new.waiting - old.waiting, 0.0)

    def shares(kind: str, which: int) -> dict[str, float]:
        out = {}
        for b, h in getattr(new, kind).items():
            target = slo.get(b, slo.get(DEFAULT_BUCKET))
            limit = target[which] if target and len(target) > which else math.inf
            share = h.minus(getattr(old, kind).get(b)).fraction_le(limit) if math.isfinite(limit) else None
            if share is not None:
                out[b] = share
        return out

    def per_request(attr: str, b: str, n: float) -> float:
        """The bucket's tokens per first token; the window's, from engines that do not label them by bucket."""
        if b not in new.by_bucket.get(attr, {}):
            return delta(attr) / firsts
        return max(new.by_bucket[attr][b] - old.by_bucket.get(attr, {}).get(b, 0.0), 0.0) / n

    ttft, itl, e2e = shares("ttft", 0), shares("itl", 1), shares("e2e", 2)
    refused = {b: max(n - old.refused.get(b, 0.0), 0.0) for b, n in new.refused.items()}
    buckets = {b: BucketWindow(n, (arrivals * n / firsts + refused.get(b, 0.0)) / dt,
                               per_request("prompt_tokens", b, n), per_request("generation_tokens", b, n),
                               ttft.get(b), itl.get(b), e2e.get(b))
               for b, n in firsts_by.items() if n > 0}
    for b, n in refused.items():  # a bucket the routers refused whole: priced at the window's mix
        if n > 0 and b not in buckets and firsts:
            buckets[b] = BucketWindow(n, n / dt, delta("prompt_tokens") / firsts, delta("generation_tokens") / firsts,
                                      None, None)
    return Window(
        now=new, seconds=dt, arrival_rate=(arrivals + sum(refused.values())) / dt,
        refused_rate=sum(refused.values()) / dt,
        mean_prompt=delta("prompt_tokens") / firsts if firsts else None,
        mean_output=delta("generation_tokens") / finished if finished else None,
        prompt_rate=delta("prompt_tokens") / dt, output_rate=delta("generation_tokens") / dt,
        preemption_rate=delta("preemptions") / dt,
        ttft_attainment=min(ttft.values(), default=None), itl_attainment=min(itl.values(), default=None),
        buckets=buckets)


def stale(sig: RoleSignals | None, now: float, max_age: float) -> bool:
    """No scrape, no pod answered, or the newest scrape is older than max_age: do not scale on it."""
    return sig is None or sig.pods == 0 or now - sig.t > max_age


@dataclass
class History:
    """One role's merged scrapes, enough of them to open a window of `span` seconds."""
    span: float
    seen: list[RoleSignals] = field(default_factory=list)

    def add(self, sig: RoleSignals) -> None:
        if self.seen and sig.t <= self.seen[-1].t:  # Prometheus answering with the scrape we already have
            return
        self.seen = [s for s in self.seen if s.t >= sig.t - 2 * self.span] + [sig]

    def window(self, now: float, slo: dict[str, tuple[float, float]]) -> Window | None:
        """From the oldest scrape within the span to the newest; None until there are two."""
        old = next((s for s in self.seen if s.t >= now - self.span), None)
        return window(old, self.seen[-1], slo) if old is not None and old is not self.seen[-1] else None
