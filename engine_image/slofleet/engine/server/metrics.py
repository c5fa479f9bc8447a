"""Prometheus metrics: vLLM-compatible names plus slofleet's per-bucket extras, one category of the observability
loop each (request shape, queue, prefill, decode, KV, tail, quality, cost).

Histograms and counters are derived from each request's lifecycle events when it finishes (and from token
timestamps for inter-token latency, and from each step for batch sizes); gauges are read from the engine's stats
snapshot at scrape time (collector.py)."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from ..engine import LLMEngine, RequestOutput
from ..request import Event, FinishReason
from ..stats import StepRecord
from .collector import EngineCollector

log = logging.getLogger("slofleet.requests")

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PRIORITY_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100)
LABELS = ("model_name", "bucket")

# A constrained answer cut by its length never closed its grammar: the schema failures model routing weighs.
STRUCTURED_DOC = ("Finished requests under an output constraint (structured outputs, required or named tools), by "
                  "reason: `length` is an answer cut before its grammar ended, a schema failure.")

class PickerCollector:
    """What the Gateway API Inference Extension's endpoint picker reads by default and vLLM V1 no longer names the
    same way: the KV usage under vLLM's former name, and the LoRA info gauge, empty while no adapter is loaded (the
    picker logs an error on every refresh of a pod without it)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def collect(self):
        kv = GaugeMetricFamily("vllm:gpu_cache_usage_perc", "Fraction of KV blocks in use (0-1); the name the "
                               "endpoint picker reads, same value as vllm:kv_cache_usage_perc.", labels=["model_name"])
        kv.add_metric([self.engine.model_name], self.engine.stats().kv_usage)
        yield kv
        # vLLM's convention: one series whose labels list the adapters and whose value is when they were read.
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters (none here).",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        lora.add_metric(["", "", "0"], time.time())
        yield lora


def registry_for(engine: LLMEngine, price_per_hour: float, buckets: tuple[str, ...]) -> CollectorRegistry:
    """The scrape-time collectors; Metrics adds its histograms and counters to the same registry."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, price_per_hour, buckets))
    registry.register(PickerCollector(engine))
    return registry


class Metrics:
    def __init__(self, engine: LLMEngine, price_per_hour: float = 0.0, buckets: Iterable[str] = ()):
        self.model, self.price_per_second, known = engine.model_name, price_per_hour / 3600, tuple(buckets)
        self.registry = registry_for(engine, price_per_hour, known)

        def hist(name: str, doc: str, bounds=LATENCY_BUCKETS, labels=LABELS) -> Histogram:
            return Histogram(name, doc, labels, buckets=bounds, registry=self.registry)

        def counter(name: str, doc: str, labels=LABELS) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        # tail: the three clocks, and the phases they are made of
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", TOKEN_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Decode time per output token after the "
                         "first, per request.", TOKEN_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("vllm:request_queue_time_seconds", "Time waiting before first scheduled (this engine "
                          "has no batching window, so this is the batch wait too).")
        self.prefill = hist("vllm:request_prefill_time_seconds", "Time from first scheduled to first token.")
        self.decode = hist("vllm:request_decode_time_seconds", "Time from first token to finish.")
        # request shape
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", LENGTH_BUCKETS)
        self.output_len = hist("vllm:request_generation_tokens", "Generated tokens per request.", LENGTH_BUCKETS)
        self.max_len = hist("vllm:request_max_num_generation_tokens", "max_tokens per request (resolved).",
                            LENGTH_BUCKETS)
        self.priority = hist("slofleet:request_priority", "Priority of each request (lower runs first).",
                             PRIORITY_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        # queue
        self.refusals = counter("slofleet:admission_refusals_by_bucket", "Requests refused by the engine's "
                                "admission limits (429).")
        # prefill
        self.computed = counter("slofleet:prefill_tokens_computed", "Prompt tokens computed (cache hits and "
                                "transferred KV excluded); over prefill time, the prefill rate.")
        self.prefix_queries = counter("slofleet:prefix_cache_queries_by_bucket", "Prompt tokens looked up in the "
                                      "prefix cache.")
        self.prefix_hits = counter("slofleet:prefix_cache_hits_by_bucket", "Prompt tokens found in the prefix cache.")
        # decode
        self.sampling = counter("slofleet:requests_by_sampling", "Finished requests by sampling mode.",
                                [*LABELS, "sampling"])
        self.step_tokens = hist("vllm:iteration_tokens_total", "Tokens per engine step.", LENGTH_BUCKETS,
                                ["model_name"])
        self.step_generated = hist("slofleet:iteration_generation_tokens", "Tokens generated per engine step "
                                   "(a drafted request may add several).", LENGTH_BUCKETS, ["model_name"])
        self.decode_batch = hist("slofleet:decode_batch_size", "Decoding sequences per engine step.", BATCH_BUCKETS,
                                 ["model_name"])
        # KV
        self.preempted = counter("slofleet:request_preemptions", "Preemptions of finished requests.")
        # quality
        self.success = counter("vllm:request_success", "Finished requests by reason.", [*LABELS, "finished_reason"])
        self.structured = counter("slofleet:structured_output_requests", STRUCTURED_DOC, [*LABELS, "finished_reason"])
        # cost
        self.busy = counter("slofleet:request_engine_seconds", "Engine step time attributed to requests (each step "
                            "split over the requests in it).")
        self.cost = counter("slofleet:request_cost", "Cost attributed to requests at --price-per-hour (their share "
                            "of step time).")
        self.last_token_at, self.zeroed = {}, set()  # request id -> its last token's time; buckets exported at 0
        for bucket in known:
            self.zero(bucket)

    def zero(self, bucket: str) -> None:
        """Export a bucket's counters and histograms at 0 before its first event: Prometheus's rate() sees no
        increase in a series that first appears with its first event, so a bucket's first refusal or abort would
        never show."""
        if bucket in self.zeroed:
            return
        self.zeroed.add(bucket)
        for c in (self.prompt_tokens, self.generation_tokens, self.refusals, self.computed, self.prefix_queries,
                  self.prefix_hits, self.preempted, self.busy, self.cost, self.ttft, self.itl, self.tpot, self.e2e,
                  self.queue, self.prefill, self.decode, self.prompt_len, self.output_len, self.max_len,
                  self.priority):
            c.labels(self.model, bucket)
        for mode in ("greedy", "sampled"):
            self.sampling.labels(self.model, bucket, mode)
        for reason in FinishReason:
            self.success.labels(self.model, bucket, str(reason))

    def refused(self, bucket: str) -> None:
        self.zero(bucket)
        self.refusals.labels(self.model, bucket).inc()

    def observe_step(self, step: StepRecord) -> None:
        self.step_tokens.labels(self.model).observe(step.num_tokens)
        self.step_generated.labels(self.model).observe(step.num_generated)
        if step.num_decodes:
            self.decode_batch.labels(self.model).observe(step.num_decodes)

    def observe(self, out: RequestOutput) -> None:
        """Called in the engine thread for every output delta."""
        req, labels = out.request, (self.model, out.request.bucket)
        self.zero(req.bucket)
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
        n_out = len(req.output_token_ids)
        if "decode_s" in t and n_out > 1:
            self.tpot.labels(*labels).observe(t["decode_s"] / (n_out - 1))
        self.prompt_len.labels(*labels).observe(req.num_prompt_tokens)
        self.output_len.labels(*labels).observe(n_out)
        self.max_len.labels(*labels).observe(req.max_tokens)
        self.priority.labels(*labels).observe(req.priority)
        self.prompt_tokens.labels(*labels).inc(req.num_prompt_tokens)
        self.computed.labels(*labels).inc(req.num_prompt_computed)
        if req.first(Event.SCHEDULED) is not None:
            self.prefix_queries.labels(*labels).inc(req.num_prompt_tokens)
            self.prefix_hits.labels(*labels).inc(req.num_cached_tokens)
        self.sampling.labels(*labels, "greedy" if req.params.greedy else "sampled").inc()
        self.preempted.labels(*labels).inc(req.count(Event.PREEMPTED))
        self.success.labels(*labels, str(out.finish_reason)).inc()
        if req.params.structured is not None:
            self.structured.labels(*labels, str(out.finish_reason)).inc()
        self.busy.labels(*labels).inc(req.busy_s)
        self.cost.labels(*labels).inc(req.busy_s * self.price_per_second)
        log.info(json.dumps({
            "event": "request_finished", "request_id": req.request_id, "bucket": req.bucket,
            "priority": req.priority, "finish_reason": str(out.finish_reason), "prompt_tokens": req.num_prompt_tokens,
            "cached_tokens": req.num_cached_tokens, "output_tokens": n_out, "preemptions": req.count(Event.PREEMPTED),
            "engine_s": round(req.busy_s, 4), **{k: round(v, 4) for k, v in t.items()}}))
