"""status.buckets and the SLO signal from the router's clocks, whatever runtime serves behind it: an LLMService
with the router on is read from its router pod's per-bucket histograms (the router's own RouterMetrics), its
engines (vLLM's names, no bucket label; llama-server's, no histograms) give queue, KV usage and phases by
contract.RUNTIME_METRICS."""
from __future__ import annotations

import http.server
import threading

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from slofleet.api.contract import LLAMACPP, RUNTIME_METRICS, VLLM, now
from slofleet.api.v1alpha1 import API_VERSION
from slofleet.autoscaler.kubemode import Autoscaler
from slofleet.autoscaler.policy import PolicyConfig
from slofleet.autoscaler.signals import parse
from slofleet.router.buckets import RoutedBucket
from slofleet.router.clocks import Clocks, observe_clocks
from slofleet.router.metrics import RouterMetrics


class Metrics:
    """A pod's /metrics, answered from whatever `text()` gives at each scrape."""

    def __init__(self, text) -> None:
        self.text = text
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the stdlib's name)
                body = me.text().encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]

    def pod(self, name: str) -> dict:
        return {"metadata": {"name": name}, "spec": {"containers": [{"ports": [{"name": "http",
                                                                                "containerPort": self.port}]}]},
                "status": {"podIP": "127.0.0.1", "startTime": now(),  # started within the window: counted from zero
                           "conditions": [{"type": "Ready", "status": "True"}]}}


class Kube:
    """The autoscaler's API calls, over one LLMService and its pods by role."""

    def __init__(self, svc: dict, pods: dict[str, list[dict]]) -> None:
        self.svc, self.by_role, self.patches = svc, pods, []

    def services(self, namespace):
        return [self.svc]

    def pods(self, namespace, selector):
        return self.by_role.get(selector.rpartition("=")[2], [])

    def patch_status(self, namespace, name, body):
        self.patches.append(body)

    def event(self, *a):
        pass


def service(runtime: str) -> dict:
    return {"apiVersion": API_VERSION, "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": "ns", "uid": "u1"},
            "spec": {"engine": {"runtime": runtime}, "router": {"enabled": True},
                     "autoscaling": {"enabled": True, "maxReplicas": 3},
                     "buckets": [{"name": "chat", "priority": 0, "slo": {"ttftMs": 200, "percentile": 90}},
                                 {"name": "doc", "priority": 1, "slo": {"tpotMs": 50, "percentile": 90}}]}}


def vllm_engine(queue: float) -> CollectorRegistry:
    """vLLM's own names, labelled by model only (no bucket), with a waiting queue and its phases."""
    reg, rm = CollectorRegistry(), RUNTIME_METRICS[VLLM]
    Gauge(rm.waiting, "w", ["model_name"], registry=reg).labels("m").set(7)
    Gauge(rm.kv_usage, "kv", ["model_name"], registry=reg).labels("m").set(0.5)
    for series, v in ((rm.queue, queue), (rm.prefill, 0.02), (rm.decode, 0.1), (rm.ttft, queue + 0.02),
                      (rm.e2e, queue + 0.12)):
        h = Histogram(series, "h", ["model_name"], registry=reg)
        for _ in range(5):
            h.labels("m").observe(v)
    return reg


@pytest.mark.parametrize("runtime", [VLLM, LLAMACPP])
def test_status_buckets_come_from_the_routers_clocks_for_any_runtime(runtime):
    router = RouterMetrics()
    chat = RoutedBucket.model_validate({"name": "chat", "slo": {"ttftMs": 200}})
    doc = RoutedBucket.model_validate({"name": "doc", "slo": {"tpotMs": 50}})
    engine = vllm_engine(0.5) if runtime == VLLM else None
    llama = "llamacpp:requests_deferred 3\nllamacpp:requests_processing 2\nllamacpp:prompt_tokens_total 90\n"
    r = Metrics(lambda: generate_latest(router.registry).decode())
    e = Metrics(lambda: generate_latest(engine).decode() if engine else llama)
    kube = Kube(service(runtime), {"router": [r.pod("chat-router-0")], "unified": [e.pod("chat-unified-0")]})
    scaler = Autoscaler(kube, PolicyConfig())
    scaler.tick()
    for i in range(10):  # chat: 8 of 10 first tokens within 200 ms; doc: every TPOT far over 50 ms
        observe_clocks(router, chat, Clocks(ttft=0.05 if i < 8 else 0.9, tpot=0.01, e2e=1.0))
        observe_clocks(router, doc, Clocks(ttft=0.1, tpot=0.3, e2e=3.0))
    st = next(iter(scaler.services.values()))
    st.due = 0.0
    scaler.tick()
    got = {b["name"]: b for b in kube.patches[-1]["status"]["buckets"]}
    assert got["chat"]["requests"] == 10 and got["chat"]["attainment"] == pytest.approx(0.8, abs=0.02)
    assert got["chat"]["met"] is False
    assert got["doc"]["requests"] == 10 and got["doc"]["attainment"] == 0.0
    # vLLM's phases carry no bucket label: its engine-wide means name the phase (its queue, 500 ms of 520)
    assert got["chat"].get("dominant") == ("queue" if runtime == VLLM else None)
    latest = st.roles["unified"].history.seen[-1]
    assert latest.waiting == (7 if runtime == VLLM else 3)  # each runtime's own queue gauge
    assert set(latest.ttft) == {"chat", "doc"}, "the SLO signal reads the router's clocks, per bucket"
    r.server.shutdown()
    e.server.shutdown()


def test_each_runtime_is_read_by_its_own_names():
    text = ("llamacpp:requests_deferred 4\nllamacpp:requests_processing 2\nllamacpp:prompt_tokens_total 100\n"
            "llamacpp:tokens_predicted_total 40\n")
    sig = parse(text, "unified", 1.0, LLAMACPP)
    assert (sig.waiting, sig.running, sig.prompt_tokens, sig.generation_tokens) == (4, 2, 100, 40)
    assert sig.kv_usage == 0.0 and not sig.ttft  # not exported by llama-server
    assert parse(text, "unified", 1.0, VLLM).waiting == 0.0  # vLLM's names do not read llama-server's series
