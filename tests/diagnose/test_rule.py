"""The diagnosis rule on hand-made metrics (no engine): which phase holds a clock in the cases the fault tests do
not reach, windows across a restart, and --prometheus answering two instant queries."""
from __future__ import annotations

import json
import math
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slofleet.api.contract import E2E, KV_USAGE, NUM_WAITING, TTFT, Sample
from slofleet.api.v1alpha1 import Bucket
from slofleet.autoscaler.diagnose import PHASE_SERIES, ROUTER_PHASE, ROUTER_TTFB, flatten, judge, since, value
from slofleet.cli import main
from tests.support import refused

BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, math.inf)


def observed(name: str, bucket: str, *values: float, **labels: str) -> list[Sample]:
    """A histogram's samples after these observations."""
    le = lambda b: "+Inf" if math.isinf(b) else str(b)  # noqa: E731
    labels["bucket"] = bucket
    return [*(Sample(f"{name}_bucket", {**labels, "le": le(b)}, sum(v <= b for v in values)) for b in BOUNDS),
            Sample(f"{name}_sum", labels, sum(values)), Sample(f"{name}_count", labels, len(values))]


def engine(bucket: str = "chat", n: int = 6, kv: float = 0.1, waiting: float = 0, **phases: float) -> list[Sample]:
    """n requests of one bucket, each spending the given seconds in queue, prefill and decode."""
    q, p, d = phases.get("queue", 0.0), phases.get("prefill", 0.0), phases.get("decode", 0.0)
    times = {"queue": q, "prefill": p, "decode": d, "ttft": q + p, "e2e": q + p + d}
    out = [s for k, t in times.items() for s in observed(PHASE_SERIES[k], bucket, *[t] * n)]
    return out + [Sample(KV_USAGE, {}, kv), Sample(NUM_WAITING, {}, waiting)]


def bucket(name: str = "chat", **slo) -> Bucket:
    return Bucket.model_validate({"name": name, "slo": {"percentile": 90, **slo}})


def test_an_answer_not_streamed_is_the_clients_streaming():
    # behind a router, a non-streamed answer's first byte is its last: the router's TTFB is the engine's E2E
    eng = flatten(engine(queue=0.01, prefill=0.2, decode=2.0))
    rtr = flatten(observed(ROUTER_TTFB, "chat", *[2.25] * 6) + observed(ROUTER_PHASE, "chat", *[0.001] * 6,
                                                                        phase="stream"))
    v = judge([bucket(ttftMs=500)], [eng], [rtr], None)
    assert (v["slow_clock"], v["dominant"]) == ("ttft", "outside_model"), v
    assert any("not streamed" in a for a in v["actions"])


def test_a_streamed_answer_held_on_the_way_is_outside_the_model():
    eng = flatten(engine(queue=0.01, prefill=0.2, decode=0.3))
    rtr = flatten(observed(ROUTER_TTFB, "chat", *[1.7] * 6))
    v = judge([bucket(ttftMs=500)], [eng], [rtr], None)
    assert (v["slow_clock"], v["dominant"]) == ("ttft", "outside_model"), v


def test_a_stream_slow_after_the_engine_finished_is_outside_the_model():
    # the router has no E2E histogram: the engine's, shifted by what the router adds after it (a slow reader)
    eng = flatten(engine(queue=0.01, prefill=0.1, decode=0.5))
    rtr = flatten(observed(ROUTER_TTFB, "chat", *[0.15] * 6) + observed(ROUTER_PHASE, "chat", *[3.0] * 6,
                                                                        phase="stream"))
    v = judge([bucket(ttftMs=500, e2eMs=1000)], [eng], [rtr], None)
    assert (v["slow_clock"], v["dominant"]) == ("e2e", "outside_model"), v
    assert v["evidence"]["clocks"]["ttft"]["met"] and v["evidence"]["mean_ms"]["router_stream"] == 3000


def test_queueing_for_a_full_kv_pool_is_kv():
    slow_queue = dict(queue=2.0, prefill=0.1, decode=0.5)
    for kv, waiting, dominant in ((0.97, 3, "kv"), (0.97, 0, "queue"), (0.5, 3, "queue")):
        v = judge([bucket(ttftMs=500)], [flatten(engine(kv=kv, waiting=waiting, **slow_queue))], [], None)
        assert v["dominant"] == dominant, (kv, waiting, v)


def test_the_worst_bucket_is_the_most_times_over_its_target():
    eng = flatten(engine("chat", queue=0.6, prefill=0.1) + engine("doc", prefill=4.0))
    v = judge([bucket("chat", ttftMs=100), bucket("doc", ttftMs=2000, e2eMs=60000)], [eng], [], None)
    assert (v["bucket"], v["slow_clock"], v["dominant"]) == ("chat", "ttft", "queue"), v
    assert [b["dominant"] for b in v["buckets"]] == ["queue", "prefill"]


def test_a_window_across_a_restart_counts_from_zero():
    old, new = flatten(engine(n=10, prefill=0.1)), flatten(engine(n=3, prefill=0.1))
    assert value(since(new, old), TTFT + "_count", "chat") == 3
    more = flatten(engine(n=12, prefill=0.1, kv=0.4))
    w = since(more, old)
    assert value(w, E2E + "_count", "chat") == 2 and value(w, KV_USAGE) == 0.4  # gauges are read, not subtracted


def test_prometheus_two_instant_queries(tmp_path, capsys):
    def vector(samples: list[Sample], service: str) -> list[dict]:
        return [{"metric": {"__name__": s.name, **s.labels, "pod": f"{service}-0"}, "value": [0, str(s.value)]}
                for s in samples]

    before = engine(n=4, queue=0.01, prefill=0.1)
    after = [s._replace(value=s.value + t.value) for s, t in zip(before, engine(n=6, queue=3.0, prefill=0.1))]
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
            asked.append((q["query"][0], float(q["time"][0])))
            service = q["query"][0].split('service="')[1].split('"')[0]
            samples = [] if not service.endswith("-unified") else before if len(asked) <= 3 else after
            body = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                             "result": vector(samples, service)}}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "policy.yaml").write_text(
        "apiVersion: slofleet.dev/v1alpha1\nkind: SLOPolicy\nmetadata: {name: p}\n"
        "spec:\n  buckets:\n  - name: chat\n    slo: {percentile: 90, ttftMs: 1000}\n")
    try:
        rc = main(["diagnose", "--prometheus", f"http://127.0.0.1:{server.server_port}", "--llmservice", "ns/svc",
                   "--buckets", str(tmp_path / "policy.yaml"), "--window", "300", "--json"])
    finally:
        server.shutdown()
    v = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(asked) == 6 and asked[0][1] == asked[-1][1] - 300  # no wait: now and 300 s ago
    assert 'namespace="ns"' in asked[0][0] and {'service="svc-unified"', 'service="svc-router"'} <= {
        a[0].split(",")[-1].rstrip("}") for a in asked}
    # the 6 requests of the window waited 3 s each; the 4 before did not count
    assert (v["slow_clock"], v["dominant"], v["buckets"][0]["requests"]) == ("ttft", "queue", 6), v


@pytest.mark.parametrize("text, says", [
    ("```not yaml", "cannot read buckets from"),
    ("- name: chat\n  slo: {percentile: 150, ttftMs: 100}\n", "invalid buckets: slo: slo.percentile must be > 0"),
])
def test_a_buckets_file_it_cannot_use_is_one_line_and_exit_2(tmp_path, capsys, text, says):
    from slofleet.autoscaler import diagnose_cli
    path = tmp_path / "buckets.yaml"
    path.write_text(text)
    refused(diagnose_cli, ["--buckets", str(path), "--url", "http://127.0.0.1:9"], says, capsys)
