"""Prometheus metrics: vLLM-compatible names plus slofleet's per-bucket extras.

Histograms and counters are derived from each request's lifecycle events when it finishes (and from
token timestamps for inter-token latency); gauges are read from the engine at scrape time."""
from __future__ import annotations

import json
import logging
import re
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine import LLMEngine, RequestOutput
from ..request import Event

log = logging.getLogger("slofleet.requests")

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


DEFAULT_BUCKET, OTHER_BUCKET = "default", "other"
MAX_SEEN_BUCKETS = 32
BUCKET_NAME = re.compile(r"[a-z0-9-]{1,63}")


class BucketLabels:
    """Bucket names become label values, so their number stays bounded: an engine with configured buckets keeps
    those; one without keeps the first MAX_SEEN_BUCKETS well-formed names it sees. The rest count as `other`."""

    def __init__(self, configured: set[str]):
        self.configured = bool(configured)
        self.known = {DEFAULT_BUCKET, *configured}

    def label(self, name: str) -> str:
        if name in self.known:
            return name
        if self.configured or len(self.known) - 1 >= MAX_SEEN_BUCKETS or not BUCKET_NAME.fullmatch(name):
            return OTHER_BUCKET
        self.known.add(name)
        return name


class EngineCollector:
    """Gauges and cumulative counters that live in the engine's own state, read at scrape time."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def collect(self):
        st, name = self.engine.stats(), self.engine.model_name

        def family(kind, metric: str, doc: str, values: dict[tuple[str, ...], float], labels: tuple[str, ...] = ()):
            f = kind(metric, doc, labels=["model_name", *labels])
            for key, value in sorted(values.items()):
                f.add_metric([name, *key], value)
            return f

        def gauge(metric: str, doc: str, value: float):
            return family(GaugeMetricFamily, metric, doc, {(): value})

        def counter(metric: str, doc: str, value: float):
            return family(CounterMetricFamily, metric, doc, {(): value})

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", st.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", st.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", st.kv_usage)
        yield gauge("slofleet:queued_prompt_tokens", "Prompt tokens not yet computed for waiting requests.",
                    st.queued_prompt_tokens)
        yield gauge("slofleet:kv_blocks_total", "KV blocks in the pool.", st.kv_blocks_total)
        yield gauge("slofleet:kv_blocks_free", "KV blocks free (cached blocks count as free).", st.kv_blocks_free)
        yield family(GaugeMetricFamily, "slofleet:num_requests_waiting_by_bucket", "Waiting requests per bucket.",
                     {(b,): n for b, n in st.waiting_by_bucket.items()}, ("bucket",))
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", st.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", st.prefix_hits)
        yield counter("vllm:num_preemptions", "Requests preempted (KV blocks freed, recomputed later).",
                      st.preemptions)
        yield counter("slofleet:prompt_tokens_computed", "Prompt tokens this engine computed (recompute included; "
                      "cache hits and transferred KV excluded).", st.steps.prompt_tokens_computed)
        yield counter("slofleet:admission_refusals", "Requests refused by the engine's admission limits.",
                      st.admission_refusals)
        yield family(CounterMetricFamily, "slofleet:preemptions_by_bucket", "Preemptions per bucket.",
                     {(b,): n for b, n in st.preemptions_by_bucket.items()}, ("bucket",))
        yield family(GaugeMetricFamily, "slofleet:dtype_info", "The dtype the engine runs in (1), and why: flag, "
                     "gpu, or probe (the faster of fp32/bf16 measured on this CPU).",
                     {(st.dtype.dtype, st.dtype.reason): 1}, ("dtype", "reason"))
        yield family(GaugeMetricFamily, "slofleet:dtype_probe_gflops", "GEMM rate the dtype probe measured at the "
                     "model's prefill and decode shapes.", {(d, shape): v for d, f in st.dtype.gflops.items()
                                                           for shape, v in f.items()}, ("dtype", "shape"))


class Metrics:
    def __init__(self, engine: LLMEngine):
        self.model = engine.model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        lb = ["model_name", "bucket"]

        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, lb, buckets=buckets, registry=self.registry)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", TOKEN_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("vllm:request_queue_time_seconds", "Time waiting before first scheduled.")
        self.prefill = hist("vllm:request_prefill_time_seconds", "Time from first scheduled to first token.")
        self.decode = hist("vllm:request_decode_time_seconds", "Time from first token to finish.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", lb,
                                     registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", lb, registry=self.registry)
        self.success = Counter("vllm:request_success", "Finished requests by reason.",
                               ["model_name", "bucket", "finished_reason"], registry=self.registry)
        self.last_token_at: dict[str, float] = {}

    def observe(self, out: RequestOutput) -> None:
        """Called in the engine thread for every output delta."""
        req, labels = out.request, (self.model, out.request.bucket)
        now = time.monotonic()
        if out.new_token_ids:
            self.generation_tokens.labels(*labels).inc(len(out.new_token_ids))
            prev = self.last_token_at.get(out.request_id)
            if prev is not None:
                self.itl.labels(*labels).observe(now - prev)
            self.last_token_at[out.request_id] = now
        if not out.finished:
            return
        self.last_token_at.pop(out.request_id, None)
        t = req.timings()
        for key, hist in (("ttft_s", self.ttft), ("e2e_s", self.e2e), ("queue_s", self.queue),
                          ("prefill_s", self.prefill), ("decode_s", self.decode)):
            if key in t:
                hist.labels(*labels).observe(t[key])
        self.prompt_tokens.labels(*labels).inc(req.num_prompt_tokens)
        self.success.labels(*labels, out.finish_reason or "unknown").inc()
        log.info(json.dumps({
            "event": "request_finished", "request_id": req.request_id, "bucket": req.bucket,
            "priority": req.priority, "finish_reason": str(out.finish_reason), "prompt_tokens": req.num_prompt_tokens,
            "cached_tokens": req.num_cached_tokens, "output_tokens": len(req.output_token_ids),
            "preemptions": req.count(Event.PREEMPTED),
            **{k: round(v, 4) for k, v in t.items()}}))
