"""Refusals are demand: the routers' admission counters -> offered load in the policy's window, the counts in
status.buckets[], and `slofleet diagnose`'s "refused at admission"."""
from __future__ import annotations

import pytest

from slofleet.api.contract import ROUTER_ADMITTED, ROUTER_REFUSED, Sample
from slofleet.api.v1alpha1 import Bucket
from slofleet.autoscaler.admissions import Ledger, from_samples
from slofleet.autoscaler.attainment import bucket_status
from slofleet.autoscaler.diagnose import flatten, judge
from slofleet.autoscaler.diagnose_cli import report
from slofleet.autoscaler.signals import parse, window
from tests.autoscaler.test_signals import SLO, scrape
from tests.diagnose.test_rule import engine


def router(t: float, admitted: float, refused: float, bucket: str = "chat") -> list[Sample]:
    return [Sample(f"{ROUTER_ADMITTED}_total", {"bucket": bucket, "mode": "slo-predicted"}, admitted),
            Sample(f"{ROUTER_REFUSED}_total", {"bucket": bucket, "reason": "predicted_ttft"}, refused),
            Sample(f"{ROUTER_REFUSED}_total", {"bucket": bucket, "reason": "rate"}, 1.0)]


def test_refused_requests_count_in_the_offered_arrival_rate():
    old = parse(scrape(0, (10, 20, 30, 30), (0, 100, 100, 100), first=30), "unified", t=0.0)
    new = parse(scrape(0, (10, 60, 70, 80), (0, 190, 200, 200), first=80), "unified", t=10.0)
    served = window(old, new, SLO)
    old.refused, new.refused = {"chat": 5.0}, {"chat": 105.0, "batch": 30.0}
    offered = window(old, new, SLO)
    # 50 first tokens in 10 s; 100 chat and 30 batch requests refused meanwhile
    assert served.arrival_rate == pytest.approx(5.0)
    assert offered.arrival_rate == pytest.approx(18.0) and offered.refused_rate == pytest.approx(13.0)
    assert offered.buckets["chat"].arrival_rate == pytest.approx(15.0)
    # a bucket refused whole is still demand, priced at the window's mix
    assert offered.buckets["batch"].arrival_rate == pytest.approx(3.0)
    assert offered.buckets["batch"].mean_prompt == pytest.approx(1000)


def test_status_shows_each_bucket_s_admitted_and_refused_by_reason():
    ledger = Ledger(window_s=300)
    ledger.add(from_samples(router(0.0, 10, 2), t=0.0))
    assert ledger.window() is None
    ledger.add(from_samples(router(0.0, 40, 20), t=60.0).plus(from_samples(router(0.0, 5, 0, "batch"), t=60.0)))
    counted = ledger.window()
    chat = Bucket.model_validate({"name": "chat", "slo": {"ttftMs": 500}})
    entry = bucket_status(chat, {}, 300, "T", None, counted)
    assert entry.admitted == 30 and entry.refused == {"predicted_ttft": 18}
    assert bucket_status(chat, {}, 300, "T").admitted is None  # no router: no counts


def test_diagnose_names_refused_at_admission_when_the_admitted_meet_their_slo():
    chat = Bucket.model_validate({"name": "chat", "slo": {"percentile": 90, "ttftMs": 500}})
    eng = flatten(engine(queue=0.01, prefill=0.1, decode=0.2))
    v = judge([chat], [eng], [flatten(router(0.0, 6, 40))], None)
    assert (v["bucket"], v["dominant"], v["slow_clock"]) == ("chat", "refused_at_admission", None)
    assert v["evidence"]["router_refused"] == 41 and "refused at admission: bucket chat" in report(v)
    assert judge([chat], [eng], [flatten(router(0.0, 6, 0))], None)["bucket"] is not None  # the rate refusal
    quiet = [s for s in router(0.0, 6, 0) if s.labels.get("reason") != "rate"]
    assert judge([chat], [eng], [flatten(quiet)], None)["bucket"] is None  # nothing refused: every bucket meets
