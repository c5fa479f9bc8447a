"""The autoscaler's Kubernetes side without a cluster: resource -> policy settings, decision -> status entry
and Event, the stale-metrics hold, scale from zero, and the Prometheus source against a stand-in server."""
import math
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, HTTPServer

from slofleet.api.v1alpha1 import LLMService, LLMServiceStatus, RoleAutoscaling
from slofleet.autoscaler import actuate
from slofleet.autoscaler.policy import Decision, Fleet, Policy, PolicyConfig
from slofleet.autoscaler.signals import History, RoleSignals, window
from slofleet.autoscaler.sources import federate
from tests.support.server import free_port

SVC = LLMService.model_validate({
    "metadata": {"name": "chat", "namespace": "ns", "uid": "u1"},
    "spec": {"topology": {"mode": "disaggregated", "prefill": {"minReplicas": 1, "maxReplicas": 4},
                          "decode": {"minReplicas": 2, "maxReplicas": 6}},
             "buckets": [{"name": "chat", "slo": {"percentile": 95, "ttftMs": 500, "tpotMs": 50}},
                         {"name": "doc", "slo": {"percentile": 99, "ttftMs": 4000}},
                         {"name": "batch", "slo": {"e2eMs": 60000}}],
             "autoscaling": {"enabled": True, "intervalSeconds": 5, "scaleUpStabilizationSeconds": 10,
                             "scaleDownStabilizationSeconds": 40, "targetKvCacheUsage": 0.7}}})


def test_settings_take_bounds_timing_and_slos_from_the_resource():
    got = actuate.settings(SVC, SVC.spec.buckets, PolicyConfig(decode_tps=123.0, cold_start_s=30.0))
    assert set(got) == {"prefill", "decode"}
    dec = got["decode"].policy
    assert (dec.role, dec.min_replicas, dec.max_replicas) == ("decode", 2, 6)
    assert (dec.up_window_s, dec.down_window_s, dec.kv_high, dec.stale_after_s) == (10, 40, 0.7, 15)
    assert (dec.decode_tps, dec.cold_start_s) == (123.0, 30.0)  # priors from the command line
    assert got["prefill"].policy.min_replicas == 1 and got["decode"].window_s == 20
    # each bucket's own targets and percentile; the policy's own SLO is the strictest of them
    assert (dec.slo.ttft_s, dec.slo.tpot_s, dec.slo.target) == (0.5, 0.05, 0.99)
    assert got["decode"].slo == {"chat": (0.5, 0.05, math.inf), "doc": (4.0, math.inf, math.inf),
                                 "batch": (math.inf, math.inf, 60.0)}
    assert (dec.buckets["chat"].target, dec.buckets["batch"].target, dec.buckets["batch"].e2e_s) == (0.95, 0.99, 60.0)
    assert (dec.grace_s, dec.signals) == (30, {"slo", "queue", "kvCache"})  # drainSeconds, and every signal


def test_a_decision_becomes_a_merge_patch_of_its_own_role_that_the_status_model_accepts():
    e = actuate.entry(Decision(3, "scale up to 3: 9.0 waiting per replica: +2", "Ok"), None, "2026-01-01T00:00:00Z")
    body = actuate.status_patch("decode", e)
    assert body == {"status": {"autoscaling": {"decode": {
        "desiredReplicas": 3, "reason": "scale up to 3: 9.0 waiting per replica: +2",
        "time": "2026-01-01T00:00:00Z", "condition": "Ok"}}}}
    assert LLMServiceStatus.model_validate(body["status"]).autoscaling["decode"] == e


def test_stale_metrics_hold_the_last_decision_and_never_invent_one():
    policy = Policy(PolicyConfig(min_replicas=1, max_replicas=4, stale_after_s=15))
    d = policy.decide(100.0, None, Fleet(ready=2))  # no window yet, nothing on record
    assert d.condition == "MetricsStale"
    e = actuate.entry(d, None, "t")
    assert e.desired_replicas is None and e.condition == "MetricsStale"  # nothing asked for on no data
    policy.last = Decision(3, "scale up to 3", "Ok")
    old, new = RoleSignals("unified", 50.0, pods=1), RoleSignals("unified", 60.0, pods=1)
    d = policy.decide(100.0, window(old, new, {}), Fleet(ready=1))  # the newest scrape is 40 s old
    assert (d.desired, d.condition) == (3, "MetricsStale") and "40s old" in d.reason
    assert actuate.entry(d, RoleAutoscaling(desired_replicas=3), "t").desired_replicas == 3


def test_events_on_count_changes_and_on_metrics_going_stale_and_back():
    ok3 = RoleAutoscaling(desired_replicas=3, reason="r", condition="Ok")
    up = actuate.event("unified", None, 1, ok3)
    assert up == ("Normal", "ScaledUp", "unified: 1 -> 3: r")
    assert actuate.event("unified", ok3, 5, RoleAutoscaling(desired_replicas=2, reason="idle", condition="Ok")) == \
        ("Normal", "ScaledDown", "unified: 3 -> 2: idle")
    stale = RoleAutoscaling(desired_replicas=3, reason="holding 3: no scrape", condition="MetricsStale")
    assert actuate.event("unified", ok3, 3, stale)[:2] == ("Warning", "MetricsStale")
    assert actuate.event("unified", stale, 3, stale) is None  # still stale: no new Event
    assert actuate.event("unified", stale, 3, ok3)[1] == "MetricsRecovered"
    assert actuate.event("unified", ok3, 3, RoleAutoscaling(desired_replicas=3, reason="other", condition="Ok")) is None
    assert len(actuate.event("unified", None, 1, RoleAutoscaling(desired_replicas=2, reason="x" * 5000))[2]) == 1024


def test_writes_only_when_the_count_or_condition_changes():
    a = RoleAutoscaling(desired_replicas=2, reason="9 waiting", condition="Ok", time="t1")
    assert actuate.changed(None, a)
    assert not actuate.changed(a, RoleAutoscaling(desired_replicas=2, reason="7 waiting", condition="Ok", time="t2"))
    assert actuate.changed(a, RoleAutoscaling(desired_replicas=2, reason="hold", condition="Stabilizing"))
    assert actuate.changed(a, RoleAutoscaling(desired_replicas=1, reason="idle", condition="Ok"))


def test_scale_from_zero_only_at_zero_with_held_requests():
    hold = Decision(0, "holding 0: metrics missing or stale (no scrape)", "MetricsStale")
    assert actuate.scale_from_zero(hold, 0, 3.0).desired == 1
    assert actuate.scale_from_zero(hold, 0, 0.0) is hold
    assert actuate.scale_from_zero(hold, 0, None) is hold  # no router pods
    assert actuate.scale_from_zero(Decision(2, "up", "Ok"), 0, 3.0).desired == 2


def test_scale_up_stabilization_takes_the_lowest_recent_recommendation():
    policy = Policy(PolicyConfig(max_replicas=8, up_window_s=10, waiting_per_replica=5))
    def busy(t: float, waiting: float):
        return window(RoleSignals("unified", t - 5, pods=1), RoleSignals("unified", t, pods=1, waiting=waiting), {})
    assert policy.decide(100.0, busy(100.0, 1), Fleet(ready=1)).desired == 1
    d = policy.decide(105.0, busy(105.0, 30), Fleet(ready=1))  # a burst within 10 s of a calm window
    assert (d.desired, d.condition) == (1, "Stabilizing")
    assert policy.decide(111.0, busy(111.0, 30), Fleet(ready=1)).desired == 2  # sustained: up
    assert Policy(PolicyConfig(max_replicas=8)).decide(105.0, busy(105.0, 30), Fleet(ready=1)).desired == 2  # no window


class StandInPrometheus(BaseHTTPRequestHandler):
    """A stand-in for a Prometheus server's /federate: two pods' series, as Prometheus writes them (untyped,
    with millisecond timestamps), only for the matcher the autoscaler must send."""
    queries: list[str] = []
    BODY = "\n".join([
        '# TYPE vllm:num_requests_waiting untyped',
        'vllm:num_requests_waiting{namespace="ns",pod="chat-decode-a",service="chat-decode"} 4 1700000010000',
        'vllm:num_requests_waiting{namespace="ns",pod="chat-decode-b",service="chat-decode"} 6 1700000012000',
        '# TYPE vllm:kv_cache_usage_perc untyped',
        'vllm:kv_cache_usage_perc{namespace="ns",pod="chat-decode-a",service="chat-decode"} 0.2 1700000010000',
        'vllm:kv_cache_usage_perc{namespace="ns",pod="chat-decode-b",service="chat-decode"} 0.6 1700000012000',
        '# TYPE vllm:time_to_first_token_seconds_bucket untyped',
        'vllm:time_to_first_token_seconds_bucket{bucket="chat",le="0.5",pod="chat-decode-a"} 7 1700000010000',
        'vllm:time_to_first_token_seconds_bucket{bucket="chat",le="+Inf",pod="chat-decode-a"} 10 1700000010000',
        ""])

    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        StandInPrometheus.queries += urllib.parse.parse_qs(url.query).get("match[]", [])
        ok = url.path == "/federate" and 'service="chat-decode"' in url.query.replace("%22", '"').replace("%3D", "=")
        self.send_response(200 if ok else 400)
        self.end_headers()
        self.wfile.write(self.BODY.encode() if ok else b"bad query")

    def log_message(self, *args):
        pass


def test_prometheus_federate_source_groups_series_by_pod():
    server = HTTPServer(("127.0.0.1", 0), StandInPrometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        pods = federate(url, "ns", "chat-decode", "decode", 2.0)
        down = federate(f"http://127.0.0.1:{free_port()}", "ns", "chat-decode", "decode", 0.5)
    finally:
        server.shutdown()
    assert StandInPrometheus.queries == \
        ['{__name__=~"vllm:.*|llamacpp:.*|slofleet:.*",namespace="ns",service="chat-decode"}']
    assert sorted((p.waiting, p.kv_usage, p.t) for p in pods) == [(4, 0.2, 1700000010.0), (6, 0.6, 1700000012.0)]
    a = next(p for p in pods if p.waiting == 4)
    assert a.ttft["chat"].fraction_le(0.5) == 0.7
    assert down == []  # no Prometheus: no data, not zero load


def test_history_ignores_a_repeated_scrape_and_opens_a_window_from_two():
    h = History(span=20)
    h.add(RoleSignals("unified", 100.0, pods=1, finished=1))
    assert h.window(101.0, {}) is None
    h.add(RoleSignals("unified", 100.0, pods=1, finished=1))  # Prometheus has nothing newer
    assert len(h.seen) == 1
    h.add(RoleSignals("unified", 110.0, pods=1, finished=5))
    w = h.window(111.0, {})
    assert w is not None and w.seconds == 10.0
