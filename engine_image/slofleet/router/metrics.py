"""The router's own Prometheus metrics, per bucket: what was admitted, shed and why, time to first byte, the SLO
clocks of every stream it relays (TTFT, TPOT, E2E, as the client sees them, whatever runtime answers), and the
router's own time by phase (what "outside the model" is made of)."""
from __future__ import annotations

import bisect
import itertools
import math
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from slofleet.api.contract import (
    ROUTER_ADMITTED,
    ROUTER_E2E,
    ROUTER_HELD,
    ROUTER_PHASE,
    ROUTER_REFUSED,
    ROUTER_SLO,
    ROUTER_TPOT,
    ROUTER_TTFT,
)
from slofleet.api.v1alpha1 import ADMISSION_MODES

from .buckets import REFUSALS

if TYPE_CHECKING:
    from slofleet.api.v1alpha1 import Bucket

PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0, 80.0)
PHASES = {  # the phase label's values
    "gateway": "arrival to authenticated, body read and validated, quota charged",
    "classify": "bucket classification and admission",
    "hold": "waiting for a ready replica (scale from zero; only requests that waited)",
    "choose": "replica choice, prefill replica included, over all tries (holding excluded)",
    "retry": "tries that failed before the one that answered (only retried requests)",
    "upstream": "the answering try, request sent to its first byte (the engine's queue and prefill, the network)",
    "handoff": "the decode engine fetching the prompt's KV from the prefill engine (its Server-Timing)",
    "own": "the router's own share of the time to first byte: all of it but the answering try's wait",
    "stream": "first byte to last byte relayed (decode, and the client's reading)",
}
TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# Bounds dense where SLO targets sit, as the engines' (vLLM's and slofleet's) latency histograms: attainment is read
# by linear interpolation inside the bound holding the target.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0)


REJECT_REASONS = ("auth", "quota", "size", "invalid", "slow_client", "shed", "draining", "no_replica", "timeout")
CUT_REASONS = ("replica_failed", "idle_timeout", "shutdown")
PD_ROUTES = ("direct", "disaggregated", "fallback")

class Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class Buckets:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # the first bound >= amount, as `le` means
        self.sum += amount


class Family:
    """A labelled counter, gauge or histogram updated per request, kept as plain numbers and turned into Prometheus
    samples when scraped. prometheus_client's own take a lock and check their type on every update, and a request
    makes about twenty; the router's one event loop is the only writer of these."""

    def __init__(self, kind: type, name: str, doc: str, labels: list[str], buckets: tuple[float, ...] = ()):
        self.kind, self.name, self.doc, self.label_names, self.bounds = kind, name, doc, labels, buckets
        self.children: dict[tuple[str, ...], Value | Buckets] = {}

    def labels(self, *values: str):
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = Buckets(self.bounds) if self.bounds else Value()
        return child

    def collect(self):
        family = self.kind(self.name, self.doc, labels=self.label_names)
        for values, child in self.children.items():
            if isinstance(child, Value):
                family.add_metric(values, child.value)
                continue
            cumulative = list(itertools.accumulate(child.counts))
            family.add_metric(values, [(floatToGoString(b), c) for b, c in zip((*child.bounds, math.inf), cumulative)],
                              child.sum)
        return family


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        counter, gauge, histogram = CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        self.requests = Family(counter, "slofleet:router_requests", "Requests answered, by bucket and HTTP status.",
                               ["bucket", "code"])
        self.rejected = Family(counter, "slofleet:router_rejected", "Requests refused by the router, by bucket and "
                               f"reason ({', '.join(REJECT_REASONS)}).", ["bucket", "reason"])
        self.inflight = Family(gauge, "slofleet:router_inflight_requests", "Requests open through the router.",
                               ["bucket"])
        self.retries = Family(counter, "slofleet:router_retries", "Requests retried on another replica before their "
                              "first byte.", ["bucket"])
        self.failovers = Family(counter, "slofleet:router_failovers", "Requests answered by another replica than "
                                "the one tried first.", ["bucket"])
        self.ttfb = Family(histogram, "slofleet:router_time_to_first_byte_seconds", "Arrival to the first byte sent "
                           "back (first token when streaming).", ["bucket"], TTFB_BUCKETS)
        self.ttft = Family(histogram, ROUTER_TTFT, "Arrival to the first token relayed (a streamed answer's first "
                           "content event; a whole JSON answer's last byte, when its client sees its first token).",
                           ["bucket"], LATENCY_BUCKETS)
        self.tpot = Family(histogram, ROUTER_TPOT, "First token to the last relayed, per output token after the "
                           "first (streamed answers of two tokens or more).", ["bucket"], TOKEN_BUCKETS)
        self.e2e = Family(histogram, ROUTER_E2E, "Arrival to the last byte relayed, of answers that ended whole.",
                          ["bucket"], LATENCY_BUCKETS)
        self.slo = Family(counter, ROUTER_SLO, "Requests judged against their bucket's SLO targets, by whether all "
                          "were met; a refused request (429, 503) counts as not met.", ["bucket", "met"])
        self.routed = Family(counter, "slofleet:router_routed", "Requests sent to a replica, by how it was chosen.",
                             ["bucket", "how"])
        self.pd_routes = Family(counter, "slofleet:router_pd_routes", "Requests served, by where their prompt was "
                                "prefilled: disaggregated (on a prefill replica), direct (a short prompt, on the "
                                "serving replica), fallback (a long prompt while no prefill replica was ready).",
                                ["bucket", "route"])
        self.cut = Family(counter, "slofleet:router_streams_cut", "Responses cut after their first byte, by reason "
                          f"({', '.join(CUT_REASONS)}).", ["bucket", "reason"])
        self.phase = Family(histogram, ROUTER_PHASE, "Time a request spends in each router "
                            "phase: " + "; ".join(f"{k}: {v}" for k, v in PHASES.items()) + ".", ["bucket", "phase"],
                            PHASE_BUCKETS)
        self.held = Family(gauge, ROUTER_HELD, "Requests waiting for a serving replica to become ready "
                           "(the autoscaler's signal to scale up from zero).", ["bucket"])
        self.families = (self.requests, self.rejected, self.inflight, self.retries, self.failovers,
                         self.ttfb, self.ttft, self.tpot,
                         self.e2e, self.slo, self.routed, self.pd_routes, self.cut, self.phase, self.held)
        self.admission = admission_families()
        r.register(self)
        self.replica_up = Gauge("slofleet:router_replica_ready", "1 while the replica passes its health checks.",
                                ["replica"], registry=r)
        self.index_blocks = Gauge("slofleet:router_prefix_index_blocks", "Entries (replica, block) in the precise "
                                  "policy's prefix index.", registry=r)
        self.index_bytes = Gauge("slofleet:router_prefix_index_bytes", "Memory the precise policy's prefix index "
                                 "holds (entries times their measured size).", registry=r)

    def zero(self, bucket: str, routes: tuple[str, ...] = ()) -> None:
        """Export a bucket's series at 0 before its first event: Prometheus's rate() sees no increase in a series
        that first appears with its first event, so a bucket's first refusal, retry or cut would never show; and
        the autoscaler reads the held gauge from the start."""
        self.held.labels(bucket)
        self.retries.labels(bucket)
        self.failovers.labels(bucket)
        self.ttfb.labels(bucket)
        self.ttft.labels(bucket)
        self.tpot.labels(bucket)
        self.e2e.labels(bucket)
        self.slo.labels(bucket, "true")
        self.slo.labels(bucket, "false")
        for how in routes:
            self.routed.labels(bucket, how)
        for reason in REJECT_REASONS:
            self.rejected.labels(bucket, reason)
        for reason in CUT_REASONS:
            self.cut.labels(bucket, reason)
        for route in PD_ROUTES:
            self.pd_routes.labels(bucket, route)
        self.zero_admission(bucket)

    def missed(self, bucket: Bucket | None) -> None:
        """A request of a bucket with an SLO that ended without an answer: refused, failed or cut."""
        if bucket is not None and bucket.slo is not None:
            self.slo.labels(bucket.name, "false").inc()

    def collect(self):
        """The per-request families, for the registry's scrape."""
        return [f.collect() for f in (*self.families, *self.admission)]

    def index(self, index) -> None:
        self.index_blocks.set(len(index))
        self.index_bytes.set(index.bytes)

    def zero_admission(self, bucket: str) -> None:
        admitted, refused = self.admission
        for mode in ADMISSION_MODES:
            admitted.labels(bucket, mode)
        for reason in REFUSALS:
            refused.labels(bucket, reason)

    def admitted(self, bucket: str, mode: str) -> None:
        self.admission[0].labels(bucket, mode).inc()

    def refused(self, bucket: str, reason: str) -> None:
        self.admission[1].labels(bucket, reason).inc()


def admission_families() -> tuple[Family, Family]:
    """Admission's counts per bucket: what the autoscaler adds up as offered load, and diagnose reads."""
    return (Family(CounterMetricFamily, ROUTER_ADMITTED, "Requests admitted, by bucket and the bucket's admission "
                   f"mode ({', '.join(ADMISSION_MODES)}).", ["bucket", "mode"]),
            Family(CounterMetricFamily, ROUTER_REFUSED, "Requests refused at admission (429 before any engine work), "
                   f"by bucket and reason ({', '.join(REFUSALS)}).", ["bucket", "reason"]))
