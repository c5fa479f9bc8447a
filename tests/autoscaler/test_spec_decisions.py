"""The LLMService fields the autoscaler's decisions read, from the resource (actuate.settings) to what the policy
sees in a window: each bucket judged at its own percentile and on every target it sets (TTFT, TPOT, E2E), the
signals that may add replicas, and drainSeconds as the time a scale-down's in-flight work must fit in."""
from __future__ import annotations

import math

from slofleet.api.v1alpha1 import LLMService
from slofleet.autoscaler import actuate
from slofleet.autoscaler.policy import Fleet, Policy, drainable
from slofleet.autoscaler.signals import Histogram, RoleSignals, window

BOUNDS = (0.1, 0.5, 1.0, 10.0, math.inf)
FAST, SLOW = (10, 10, 10, 10, 10), (0, 0, 0, 10, 10)  # 10 requests under 0.1 s, or between 1 and 10 s
NINE_FAST = (9, 9, 9, 10, 10)  # 9 under 0.1 s, 1 slow


def service(buckets: list[dict], **spec) -> LLMService:
    return LLMService.model_validate({"metadata": {"name": "s", "namespace": "ns"},
                                      "spec": {"buckets": buckets, "autoscaling": {"enabled": True}, **spec}})


def policy(svc: LLMService) -> tuple[Policy, dict]:
    rs = actuate.settings(svc, svc.spec.buckets, actuate.PolicyConfig())["unified"]
    return Policy(rs.policy), rs.slo


def scrapes(ttft: dict, itl: dict | None = None, e2e: dict | None = None, **gauges) -> tuple[RoleSignals, RoleSignals]:
    """Two scrapes of one engine: nothing before, then these per-bucket histograms (cumulative counts)."""
    def hists(counts: dict | None) -> dict:
        return {b: Histogram(BOUNDS, c) for b, c in (counts or {}).items()}
    old = RoleSignals("unified", 0.0, pods=1)
    new = RoleSignals("unified", 10.0, pods=1, ttft=hists(ttft), itl=hists(itl), e2e=hists(e2e),
                      prompt_tokens=100.0, generation_tokens=100.0, finished=10.0, **gauges)
    return old, new


def misses(svc: LLMService, **seen) -> list[str]:
    p, slo = policy(svc)
    miss, full = p.pressure(window(*scrapes(**seen), slo))
    return miss + full


def test_each_bucket_is_judged_at_its_own_percentile():
    # The same 10 requests in both buckets, 9 of them within the 250 ms target: a p50 met, a p99 missed.
    seen = {"ttft": {"median": NINE_FAST, "tail": NINE_FAST}}
    at = misses(service([{"name": "median", "slo": {"percentile": 50, "ttftMs": 250}},
                         {"name": "tail", "slo": {"ttftMs": 250}}]), **seen)
    assert any("tail" in m for m in at) and not any("median" in m for m in at), at
    default = misses(service([{"name": "median", "slo": {"ttftMs": 250}}, {"name": "tail", "slo": {"ttftMs": 250}}]),
                     **seen)
    assert any("median" in m for m in default)  # at the default p99 it misses too


def test_a_bucket_missing_only_its_e2e_target_counts():
    # A fast first token, a slow whole request (1-10 s against 5 s).
    seen = {"ttft": {"doc": FAST}, "e2e": {"doc": SLOW}}
    assert any("doc" in m for m in misses(service([{"name": "doc", "slo": {"e2eMs": 500}}]), **seen))
    assert not misses(service([{"name": "doc", "slo": {"ttftMs": 500}}]), **seen)


def test_a_bucket_over_its_tpot_target_is_a_miss():
    seen = {"ttft": {"chat": FAST}, "itl": {"chat": SLOW}}
    assert any("chat" in m for m in misses(service([{"name": "chat", "slo": {"ttftMs": 500, "tpotMs": 50}}]), **seen))
    assert not misses(service([{"name": "chat", "slo": {"ttftMs": 500}}]), **seen)


def test_signals_name_what_adds_replicas():
    chat = [{"name": "chat", "slo": {"ttftMs": 500}}]
    seen = {"ttft": {"chat": SLOW}, "waiting": 50.0, "kv_usage": 0.99}  # all three: SLO, queue, KV

    def kinds(signals: list[str] | None) -> set[str]:
        spec = {"autoscaling": {"enabled": True, **({"signals": signals} if signals is not None else {})}}
        found = misses(service(chat, **spec), **seen)
        return {k for k, word in (("slo", "attainment"), ("queue", "waiting"), ("kvCache", "KV")) if
                any(word in m for m in found)}

    assert kinds(None) == {"slo", "queue", "kvCache"}  # the default: every signal
    assert kinds(["queue"]) == {"queue"}
    assert kinds(["slo", "kvCache"]) == {"slo", "kvCache"}
    assert kinds([]) == set()  # the arrival-rate forecast alone


def test_drain_seconds_is_the_time_a_scale_down_must_fit_in():
    # In-flight requests of ~500 tokens at a 50 ms TPOT target need ~25 s to finish.
    chat = [{"name": "chat", "slo": {"ttftMs": 500, "tpotMs": 50}}]
    old, new = scrapes({"chat": FAST})
    win = window(old, new, {})
    win.mean_output = 500.0

    def fits(**engine) -> bool:
        p, _ = policy(service(chat, engine=engine))
        return drainable(win, Fleet(ready=2), 1, p.cfg)[0]

    assert fits() and fits(drainSeconds=60)  # the default 30 s holds them
    assert not fits(drainSeconds=20)
