"""The diagnosis behind a router for every runtime, on hand-made metrics: the router's SLO clocks judge, the
engine's phases come by its own names (vLLM's without a bucket label, llama-server's not at all), and what a
runtime does not export is said, not guessed."""
from __future__ import annotations

from slofleet.api.contract import LLAMACPP, ROUTER_E2E, ROUTER_TPOT, ROUTER_TTFT, RUNTIME_METRICS, VLLM, Sample
from slofleet.autoscaler.diagnose import flatten, judge

from .test_rule import bucket, observed


def router(bucket_name: str, ttft: float, tpot: float, e2e: float, n: int = 6) -> list[Sample]:
    return [*observed(ROUTER_TTFT, bucket_name, *[ttft] * n), *observed(ROUTER_TPOT, bucket_name, *[tpot] * n),
            *observed(ROUTER_E2E, bucket_name, *[e2e] * n)]


def unlabelled(samples: list[Sample]) -> list[Sample]:
    """As vLLM exports them: no bucket label, a model name instead."""
    return [Sample(s.name, {**{k: v for k, v in s.labels.items() if k != "bucket"}, "model_name": "m"}, s.value)
            for s in samples]


def vllm(queue: float, prefill: float, decode: float, n: int = 6) -> list[Sample]:
    rm = RUNTIME_METRICS[VLLM]
    times = {rm.queue: queue, rm.prefill: prefill, rm.decode: decode, rm.ttft: queue + prefill,
             rm.e2e: queue + prefill + decode}
    out = [s for name, t in times.items() for s in observed(name, "", *[t] * n)]
    return unlabelled(out) + [Sample(rm.waiting, {"model_name": "m"}, 9), Sample(rm.kv_usage, {}, 0.2)]


def test_a_queue_dominated_vllm_bucket_is_named_from_engine_wide_phases_and_router_clocks():
    eng = flatten(vllm(queue=2.0, prefill=0.1, decode=0.5))
    rtr = flatten(router("chat", ttft=2.15, tpot=0.02, e2e=2.7) + router("doc", ttft=0.2, tpot=0.02, e2e=1.0))
    v = judge([bucket("chat", ttftMs=500), bucket("doc", ttftMs=500)], [eng], [rtr], None)
    assert (v["bucket"], v["slow_clock"], v["dominant"]) == ("chat", "ttft", "queue"), v
    chat = v["evidence"]
    assert chat["clocks"]["ttft"]["series"] == ROUTER_TTFT and chat["requests"] == 6
    assert chat["runtime"] == VLLM and chat["not_exported"] == {} and chat["requests_waiting"] == 9
    assert [b["met"] for b in v["buckets"]] == [False, True]


def test_llamacpp_phases_are_not_exported_and_not_guessed():
    eng = flatten([Sample("llamacpp:requests_deferred", {}, 5), Sample("llamacpp:requests_processing", {}, 2)])
    rtr = flatten(router("chat", ttft=3.0, tpot=0.02, e2e=3.5))
    v = judge([bucket("chat", ttftMs=500)], [eng], [rtr], None)
    assert (v["bucket"], v["slow_clock"], v["dominant"]) == ("chat", "ttft", None), v
    e = v["evidence"]
    assert e["runtime"] == LLAMACPP and e["shares"] == {} and e["requests_waiting"] == 5
    assert e["not_exported"]["queue"] == "not exported by llamacpp"
    assert set(e["not_exported"]) == {"queue", "prefill", "decode", "ttft", "e2e", "tpot"}
    assert "not exported by llamacpp" in v["actions"][0]
