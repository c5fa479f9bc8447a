"""Gauges and cumulative counters that live in the engine's own state, read at scrape time from one stats snapshot;
and the bound on bucket names as label values."""
from __future__ import annotations

import re
import time
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from slofleet.api.contract import DEFAULT_BUCKET

from ..engine import LLMEngine

OTHER_BUCKET = "other"
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

    def __init__(self, engine: LLMEngine, price_per_hour: float = 0.0, buckets: Iterable[str] = ()):
        self.engine, self.price_per_hour = engine, price_per_hour
        self.buckets = tuple(buckets)  # exported at 0 before their first event (Metrics.zero says why)
        self.started = time.monotonic()

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
                     {(b,): n for b, n in {**dict.fromkeys(self.buckets, 0), **st.preemptions_by_bucket}.items()},
                     ("bucket",))
        for metric, doc, values in (
                ("slofleet:spec_draft_tokens", "Speculative draft tokens verified, per bucket.", st.spec.drafted),
                ("slofleet:spec_accepted_tokens", "Speculative draft tokens accepted, per bucket (over draft tokens: "
                 "the acceptance rate).", st.spec.accepted),
                ("slofleet:spec_drafts", "Drafted decode steps, per bucket (1 + accepted tokens over drafts: tokens "
                 "per drafted step).", st.spec.drafts)):
            yield family(CounterMetricFamily, metric, doc, {(b,): n for b, n in values.items()}, ("bucket",))
        yield gauge("slofleet:kv_cache_bytes_total", "Bytes of the KV block pool.",
                    st.kv_blocks_total * st.kv_block_bytes)
        yield gauge("slofleet:kv_cache_bytes_used", "Bytes of KV blocks in use.",
                    (st.kv_blocks_total - st.kv_blocks_free) * st.kv_block_bytes)
        yield gauge("slofleet:kv_unfilled_slots", "Token slots allocated to running requests but not yet filled "
                    "(fragmentation).", st.kv_unfilled_slots)
        yield counter("slofleet:kv_evictions", "Cached KV blocks evicted to make room.", st.kv_evictions)
        yield family(GaugeMetricFamily, "vllm:cache_config_info", "The KV cache's configuration (1), as vLLM exports "
                     "it for endpoint pickers.", {(str(self.engine.config.block_size), str(st.kv_blocks_total)): 1},
                     ("block_size", "num_gpu_blocks"))
        yield counter("slofleet:replica_cost", "What this replica has cost since it started, at --price-per-hour "
                      "(idle time included).", self.price_per_hour * (time.monotonic() - self.started) / 3600)
        yield family(GaugeMetricFamily, "slofleet:dtype_info", "The dtype the engine runs in (1), and why: flag, "
                     "gpu, or probe (the faster of fp32/bf16 measured on this CPU).",
                     {(st.dtype.dtype, st.dtype.reason): 1}, ("dtype", "reason"))
        yield family(GaugeMetricFamily, "slofleet:dtype_probe_gflops", "GEMM rate the dtype probe measured at the "
                     "model's prefill and decode shapes.", {(d, shape): v for d, f in st.dtype.gflops.items()
                                                           for shape, v in f.items()}, ("dtype", "shape"))
