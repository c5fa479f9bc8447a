"""After a mixed load, /metrics holds every category of the observability loop per bucket, with observations:
request shape, queue, prefill, decode, KV, tail, quality and cost."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from slofleet.api.contract import BUCKET_HEADER, parse_samples
from tests.support.server import Server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
DOC = "The harbour has four piers, a lighthouse and a fish market that opens at dawn. " * 12
# category -> the per-bucket series that must have observations in every bucket
PER_BUCKET = {
    "request shape": ["vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                      "vllm:request_max_num_generation_tokens_count"],
    "queue": ["vllm:request_queue_time_seconds_count", "slofleet:request_priority_count"],
    "prefill": ["vllm:request_prefill_time_seconds_count", "slofleet:prefill_tokens_computed_total",
                "slofleet:prefix_cache_queries_by_bucket_total"],
    "decode": ["vllm:request_time_per_output_token_seconds_count", "vllm:request_decode_time_seconds_count",
               "slofleet:requests_by_sampling_total"],
    "tail": ["vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
             "vllm:e2e_request_latency_seconds_count"],
    "quality": ["vllm:request_success_total"],
    "cost": ["slofleet:request_engine_seconds_total", "slofleet:request_cost_total"],
}
ENGINE_WIDE = {"KV": ["slofleet:kv_cache_bytes_total", "slofleet:kv_cache_bytes_used", "vllm:kv_cache_usage_perc",
                      "slofleet:kv_unfilled_slots", "slofleet:kv_evictions_total"],
               "decode": ["vllm:iteration_tokens_total_count", "slofleet:decode_batch_size_count"],
               "cost": ["slofleet:replica_cost_total"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--bucket-priorities", "chat=0,doc=5", "--price-per-hour", "3.6", "--max-waiting-requests", "3",
                 "--max-model-len", "1024", log=tmp_path_factory.mktemp("obs") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


async def mixed_load(url: str, at_once: bool) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(bucket: str, prompt: str, **extra) -> int:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, **extra}
            r = await client.post(url + "/v1/completions", json=body, headers={BUCKET_HEADER: bucket})
            return r.status_code

        chats = [one("chat", f"Question {i}: what is {i} plus {i}?", temperature=0) for i in range(4)]
        docs = [one("doc", DOC + f"Summarise part {i}.", temperature=0.8, seed=i) for i in range(4)]
        if at_once:  # more than --max-waiting-requests: some may be refused, the doc bucket's first
            return list(await asyncio.gather(*chats, *docs))
        return [await c for c in chats + docs]


def test_every_category_is_observed_per_bucket(server):
    codes = asyncio.run(mixed_load(server.url, at_once=True))
    # one at a time, nothing is refused, so every bucket has finished requests and the documents' prefix is cached
    assert asyncio.run(mixed_load(server.url, at_once=False)) == [200] * 8
    assert set(codes) <= {200, 429}, codes
    samples = parse_samples(httpx.get(server.url + "/metrics", timeout=10).text)
    by_bucket: dict[tuple[str, str], float] = {}
    for s in samples:
        if "bucket" in s.labels:
            key = (s.name, s.labels["bucket"])
            by_bucket[key] = by_bucket.get(key, 0.0) + s.value
    names = {s.name for s in samples}
    for category, series in PER_BUCKET.items():
        for name in series:
            for bucket in ("chat", "doc"):
                assert by_bucket.get((name, bucket), 0) > 0, f"{category}: {name}{{bucket={bucket}}} not observed"
    for category, series in ENGINE_WIDE.items():
        assert set(series) <= names, f"{category}: missing {set(series) - names}"
    sampling = {(s.labels["bucket"], s.labels["sampling"]) for s in samples
                if s.name == "slofleet:requests_by_sampling_total"}
    assert {("chat", "greedy"), ("doc", "sampled")} <= sampling
    assert by_bucket.get(("slofleet:prefix_cache_hits_by_bucket_total", "doc"), 0) > 0  # the shared document
    reasons = {s.labels["finished_reason"] for s in samples if s.name == "vllm:request_success_total"}
    assert reasons <= {"stop", "length", "abort", "deadline", "error"} and reasons
    if 429 in codes:
        assert sum(v for (n, _), v in by_bucket.items() if n == "slofleet:admission_refusals_by_bucket_total") > 0
