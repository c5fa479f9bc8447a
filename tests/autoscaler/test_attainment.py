"""status.buckets from engines' histograms: a window of few requests per bucket, each bucket judged at its own
percentile, e2eMs counted, pods summed, a new pod counted from zero and a gone one kept until its requests age out.
The engines' side is prometheus_client's text, as an engine's /metrics answers."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from slofleet.api.contract import E2E, ITL, TTFT
from slofleet.api.v1alpha1 import Bucket, BucketStatus
from slofleet.autoscaler.attainment import Observed, bucket_status, same, status_patch
from slofleet.autoscaler.signals import parse

BOUNDS = (0.01, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
WINDOW = 300.0


class Engine:
    """One engine pod's latency histograms, labelled by bucket as the engine labels them."""

    def __init__(self, pod: str):
        self.pod, self.registry = pod, CollectorRegistry()
        self.h = {n: Histogram(n, n, ["model_name", "bucket"], buckets=BOUNDS, registry=self.registry)
                  for n in (TTFT, ITL, E2E)}

    def serve(self, bucket: str, ttft: float, e2e: float, itl: float = 0.02, tokens: int = 4) -> None:
        self.h[TTFT].labels("m", bucket).observe(ttft)
        self.h[E2E].labels("m", bucket).observe(e2e)
        for _ in range(tokens - 1):
            self.h[ITL].labels("m", bucket).observe(itl)

    def scrape(self, t: float, role: str = "unified"):
        sig = parse(generate_latest(self.registry).decode(), role, t)
        sig.pod = self.pod
        return sig


def bucket(name: str, **slo) -> Bucket:
    return Bucket.model_validate({"name": name, "slo": slo})


def statuses(obs: Observed, now: float, *buckets: Bucket) -> dict[str, BucketStatus]:
    hists = obs.delta(now)
    return {b.name: bucket_status(b, hists, obs.window_s, "T") for b in buckets}


def test_few_requests_in_several_buckets_each_get_their_figures():
    e, obs = Engine("a"), Observed(WINDOW)
    obs.add(e.scrape(100.0), started=90.0)
    for ttft in (0.05, 0.07, 0.3):  # chat: 3 requests, one over its 250 ms
        e.serve("chat", ttft, 1.0)
    e.serve("doc", 0.2, 3.0)  # doc: 1 request within its e2e target
    obs.add(e.scrape(110.0))
    chat, tpot, doc = bucket("chat", ttftMs=250, percentile=50), bucket("tpot", tpotMs=5), bucket("doc", e2eMs=5000)
    got = statuses(obs, 110.0, chat, tpot, doc)
    assert got["chat"].requests == 3 and got["chat"].attainment == pytest.approx(2 / 3, abs=1e-3)
    assert got["chat"].met is True  # the median is within 250 ms
    assert 10 < got["chat"].ttft_ms < 100 and got["chat"].e2e_ms is None  # only the targets it sets
    assert (got["doc"].requests, got["doc"].attainment, got["doc"].met) == (1, 1.0, True)
    assert got["doc"].e2e_ms is not None and got["doc"].ttft_ms is None
    assert got["tpot"].requests == 0 and got["tpot"].attainment is None and got["tpot"].met is None  # no requests
    assert {b.window_seconds for b in got.values()} == {300}


def test_the_percentile_is_judged_per_bucket():
    e, obs = Engine("a"), Observed(WINDOW)
    obs.add(e.scrape(0.0), started=0.0)
    for i in range(10):  # the same 10 requests in two buckets: 9 fast, 1 slow
        for b in ("p50", "p99"):
            e.serve(b, 0.05 if i else 0.7, 1.0)
    obs.add(e.scrape(10.0))
    got = statuses(obs, 10.0, bucket("p50", ttftMs=250, percentile=50), bucket("p99", ttftMs=250, percentile=99))
    assert got["p50"].attainment == got["p99"].attainment == pytest.approx(0.9)
    assert got["p50"].met is True and got["p50"].ttft_ms < 250
    assert got["p99"].met is False and got["p99"].ttft_ms > 250


def test_e2e_counts_and_several_targets_take_the_least_met():
    e, obs = Engine("a"), Observed(WINDOW)
    obs.add(e.scrape(0.0), started=0.0)
    for _ in range(4):
        e.serve("doc", 0.05, 8.0)  # a fast first token, a slow whole request
    obs.add(e.scrape(10.0))
    got = statuses(obs, 10.0, bucket("doc", ttftMs=250, e2eMs=5000), bucket("ttft-only", ttftMs=250))
    assert got["doc"].attainment == 0.0 and got["doc"].met is False and got["doc"].e2e_ms > 5000
    assert got["doc"].ttft_ms < 250


def test_pods_sum_a_new_pod_counts_from_zero_and_old_requests_leave_the_window():
    a, b, obs = Engine("a"), Engine("b"), Observed(WINDOW)
    a.serve("chat", 0.05, 1.0)  # before the autoscaler's first look at a pod that started long ago: a baseline
    obs.add(a.scrape(1000.0), started=0.0)
    b.serve("chat", 0.05, 1.0)  # b started within the window and served before its first scrape: counted
    obs.add(b.scrape(1000.0), started=990.0)
    a.serve("chat", 0.7, 1.0)
    obs.add(a.scrape(1010.0))
    got = statuses(obs, 1010.0, bucket("chat", ttftMs=250))
    assert got["chat"].requests == 2 and got["chat"].attainment == pytest.approx(0.5)
    obs.add(a.scrape(1200.0))  # pod b is gone (no more scrapes): its request stays until it leaves the window
    assert statuses(obs, 1200.0, bucket("chat", ttftMs=250))["chat"].requests == 2
    obs.add(a.scrape(1400.0))  # now past b's last scrape and a's slow request: nothing in the window
    assert statuses(obs, 1400.0, bucket("chat", ttftMs=250))["chat"].requests == 0
    assert list(obs.pods) == ["a"]


def test_the_patch_carries_the_worst_attainment_and_clears_it_without_requests():
    e1 = BucketStatus(name="chat", requests=3, attainment=0.5, met=False, time="T1")
    e2 = BucketStatus(name="doc", requests=1, attainment=1.0, met=True, time="T1")
    patch = status_patch([e1, e2])["status"]
    assert patch["attainment"] == 0.5 and [b["name"] for b in patch["buckets"]] == ["chat", "doc"]
    assert status_patch([BucketStatus(name="chat")])["status"]["attainment"] is None  # null: removed
    assert same([e1], [e1.model_copy(update={"time": "T2"})]) and not same([e1], [e2]) and not same(None, [e1])


@pytest.mark.parametrize("queue,prefill,want", [(0.9, 0.05, "queue"), (0.05, 0.9, "prefill")])
def test_a_missed_bucket_names_its_dominant_phase(queue, prefill, want):
    """The phases' means come from the engines' queue/prefill/decode histograms, judged as `slofleet diagnose`."""
    reg = CollectorRegistry()
    phase = {n: Histogram(n, n, ["model_name", "bucket"], buckets=BOUNDS, registry=reg)
             for n in (TTFT, E2E, "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                       "vllm:request_decode_time_seconds")}
    obs = Observed(WINDOW)
    obs.add(parse(generate_latest(reg).decode(), "unified", 0.0))
    for _ in range(6):
        for name, v in ((TTFT, queue + prefill), (E2E, queue + prefill + 0.1),
                        ("vllm:request_queue_time_seconds", queue), ("vllm:request_prefill_time_seconds", prefill),
                        ("vllm:request_decode_time_seconds", 0.1)):
            phase[name].labels("m", "chat").observe(v)
    obs.add(parse(generate_latest(reg).decode(), "unified", 10.0))
    hists = obs.delta(10.0)
    chat = bucket("chat", ttftMs=200)
    got = bucket_status(chat, hists, WINDOW, "T", obs.phase_means().get("chat"))
    assert got.met is False and got.dominant == want
    easy = bucket_status(bucket("chat", ttftMs=5000), hists, WINDOW, "T", obs.phase_means().get("chat"))
    assert easy.met is True and easy.dominant is None  # only a missed bucket names one
