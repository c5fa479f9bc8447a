"""The router's own Prometheus metrics, per bucket: what was admitted, shed and why, time to first byte, and the
router's own time by phase (what "outside the model" is made of)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from slofleet.api.contract import ROUTER_HELD

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


class Cached:
    """A labelled metric whose children are looked up once per label values: prometheus_client's own labels()
    takes a lock and checks and converts every value, a dozen times per request on the router's hot path."""

    def __init__(self, metric) -> None:
        self.metric, self.children = metric, {}

    def labels(self, *values: str):
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self.metric.labels(*values)
        return child


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("slofleet:router_requests", "Requests answered, by bucket and HTTP status.",
                                ["bucket", "code"], registry=r)
        self.rejected = Counter("slofleet:router_rejected", "Requests refused by the router, by bucket and reason "
                                "(auth, quota, size, invalid, slow_client, shed, draining, no_replica, timeout).",
                                ["bucket", "reason"], registry=r)
        self.inflight = Gauge("slofleet:router_inflight_requests", "Requests open through the router.", ["bucket"],
                              registry=r)
        self.retries = Counter("slofleet:router_retries", "Requests retried on another replica before their first "
                               "byte.", ["bucket"], registry=r)
        self.ttfb = Histogram("slofleet:router_time_to_first_byte_seconds", "Arrival to the first byte sent back "
                              "(first token when streaming).", ["bucket"], buckets=TTFB_BUCKETS, registry=r)
        self.replica_up = Gauge("slofleet:router_replica_ready", "1 while the replica passes its health checks.",
                                ["replica"], registry=r)
        self.routed = Counter("slofleet:router_routed", "Requests sent to a replica, by how it was chosen.",
                                ["bucket", "how"], registry=r)
        self.pd_routes = Counter("slofleet:router_pd_routes", "Requests served, by where their prompt was "
                                 "prefilled: disaggregated (on a prefill replica), direct (a short prompt, on the "
                                 "serving replica), fallback (a long prompt while no prefill replica was ready).",
                                 ["bucket", "route"], registry=r)
        self.cut = Counter("slofleet:router_streams_cut", "Responses cut after their first byte, by reason "
                           "(replica_failed, idle_timeout, shutdown).", ["bucket", "reason"], registry=r)
        self.phase = Histogram("slofleet:router_phase_seconds", "Time a request spends in each router phase: "
                               + "; ".join(f"{k}: {v}" for k, v in PHASES.items()) + ".", ["bucket", "phase"],
                               buckets=PHASE_BUCKETS, registry=r)
        self.index_blocks = Gauge("slofleet:router_prefix_index_blocks", "Entries (replica, block) in the precise "
                                  "policy's prefix index.", registry=r)
        self.index_bytes = Gauge("slofleet:router_prefix_index_bytes", "Memory the precise policy's prefix index "
                                 "holds (entries times their measured size).", registry=r)
        self.held = Gauge(ROUTER_HELD, "Requests waiting for a serving replica to become ready "
                          "(the autoscaler's signal to scale up from zero).", ["bucket"], registry=r)
        for name in ("requests", "rejected", "inflight", "retries", "ttfb", "routed", "pd_routes", "cut", "phase",
                     "held"):  # the ones labelled per request
            setattr(self, name, Cached(getattr(self, name)))

    def index(self, index) -> None:
        self.index_blocks.set(len(index))
        self.index_bytes.set(index.bytes)
