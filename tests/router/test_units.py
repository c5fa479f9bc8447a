"""Router pieces without the proxy: classification, admission, quotas, keys, discovery, balancing, probes."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from slofleet.router.balancer import Balancer, Ring, prefix_key
from slofleet.router.buckets import Admission, Classifier, load_buckets, parse_buckets
from slofleet.router.gateway import GatewayError, KeyStore, Quotas, digest, parse_keys
from slofleet.router.replicas import Replica, ReplicaSet, endpoints_from_slices, parse_load

SERVICE = """
apiVersion: slofleet.dev/v1alpha1
kind: LLMService
spec:
  buckets:
  - name: chat
    priority: 0
    match: {maxPromptTokens: 100, maxOutputTokens: 256}
    slo: {ttftMs: 300}
    admission: {maxWaitingRequests: 2}
  - name: agent
    priority: 2
    match: {header: {X-Agent: "yes"}}
    slo: {e2eMs: 30000}
  - name: doc
    priority: 5
    match: {minPromptTokens: 101, route: /v1/completions}
    slo: {ttftMs: 5000}
"""


def test_classify_from_an_llmservice(tmp_path):
    (tmp_path / "svc.yaml").write_text(SERVICE)
    c = Classifier(load_buckets(tmp_path / "svc.yaml"))
    assert [b.name for b in c.buckets] == ["chat", "agent", "doc", "default"]  # a catch-all is added
    assert c.classify(50, 100, {}, "/v1/chat/completions").name == "chat"
    assert c.classify(50, None, {}, "/v1/chat/completions").name == "default"  # no max_tokens: may run long
    assert c.classify(50, 1000, {"x-agent": "yes"}, "/v1/chat/completions").name == "agent"
    assert c.classify(500, 10, {}, "/v1/completions").name == "doc"
    assert c.classify(500, 10, {}, "/v1/chat/completions").name == "default"
    assert c.share == {0: 1.0, 2: 0.75, 5: 0.5}  # the catch-all takes the least critical priority


def test_admission_limits_and_shedding_order():
    chat, batch = parse_buckets([{"name": "chat", "priority": 0, "admission": {"maxWaitingRequests": 1}},
                                 {"name": "batch", "priority": 9, "match": {"route": "/x"}}])
    c = Classifier([batch, chat], min_share=0.5)
    t = c.admit(chat, 10, inflight=0, capacity=10)
    with pytest.raises(Admission, match="1 requests waiting"):
        c.admit(chat, 10, inflight=1, capacity=10)
    c.release(t)
    c.release(t)  # idempotent
    assert c.state["chat"].waiting == 0
    c.admit(chat, 10, inflight=9, capacity=10)
    with pytest.raises(Admission, match="over capacity"):
        c.admit(batch, 10, inflight=5, capacity=10)
    with pytest.raises(Admission, match="no ready replica"):
        c.admit(chat, 10, inflight=0, capacity=0)


def test_requests_per_second_limit():
    (b,) = parse_buckets([{"name": "default", "admission": {"max_requests_per_second": 2}}])
    c = Classifier([b])
    c.admit(b, 1, 0, 100), c.admit(b, 1, 0, 100)
    with pytest.raises(Admission) as e:
        c.admit(b, 1, 0, 100)
    assert e.value.retry_after >= 1


def test_keys_file_and_env(tmp_path, monkeypatch):
    keys = parse_keys("# comment\nsk-a rpm=5\n\nsk-b name=bob tpm=7 # trailing\n", rpm=1, tpm=2)
    a, b = keys[digest("sk-a")], keys[digest("sk-b")]  # held as digests only
    assert (a.rpm, a.tpm) == (5, 2) and (b.name, b.rpm, b.tpm) == ("bob", 1, 7)
    assert "sk-a" not in a.name
    monkeypatch.setenv("KEYS", "sk-env1,sk-env2")
    store = KeyStore(None, "KEYS")
    assert store.authenticate({"authorization": "Bearer sk-env2"}) is not None
    assert store.authenticate({"x-api-key": "sk-env1"}) is not None
    with pytest.raises(GatewayError, match="missing"):
        store.authenticate({})
    assert KeyStore(None, "UNSET_VAR").authenticate({}) is None  # no keys configured: auth is off
    empty = tmp_path / "keys"
    empty.write_text("")
    with pytest.raises(GatewayError):  # a configured but empty file fails closed
        KeyStore(str(empty), None).authenticate({"authorization": "Bearer x"})


def test_quota_refills_over_time(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("slofleet.router.gateway.time.monotonic", lambda: clock[0])
    (q,) = parse_keys("k rpm=2 tpm=0", 0, 0).values()
    quotas = Quotas()
    quotas.charge(q, 5, 5)
    quotas.charge(q, 5, 5)
    with pytest.raises(GatewayError) as e:
        quotas.charge(q, 5, 5)
    assert e.value.status == 429 and e.value.retry_after == 30
    clock[0] += 30
    quotas.charge(q, 5, 5)


def test_endpoint_slices():
    slices = [
        {"ports": [{"name": "http", "port": 8000}, {"name": "metrics", "port": 9000}],
         "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                       {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                       {"addresses": ["fd00::3"]}]},
        {"ports": [{"name": "other", "port": 1}], "endpoints": [{"addresses": ["10.0.0.9"]}]},
        {"metadata": {"labels": {"slofleet.dev/role": "prefill"}}, "ports": [{"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["10.0.1.1"]}]},
    ]
    assert endpoints_from_slices(slices, "http") == {"http://10.0.0.1:8000": "unified",
                                                     "http://10.0.1.1:8000": "prefill",
                                                     "http://[fd00::3]:8000": "unified"}
    from kubernetes.client import (
        DiscoveryV1EndpointPort,
        V1Endpoint,
        V1EndpointConditions,
        V1EndpointSlice,
        V1ObjectMeta,
    )
    model = V1EndpointSlice(address_type="IPv4", ports=[DiscoveryV1EndpointPort(name="http", port=8000)],
                            metadata=V1ObjectMeta(labels={"slofleet.dev/role": "decode"}),
                            endpoints=[V1Endpoint(addresses=["10.1.1.1"], conditions=V1EndpointConditions(ready=True))])
    assert endpoints_from_slices([model], None) == {"http://10.1.1.1:8000": "decode"}


def test_parse_engine_metrics():
    text = ('# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{model_name="m"} 3.0\n'
            'vllm:num_requests_running{model_name="m"} 2.0\nvllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
            'vllm:num_requests_waiting_by_bucket{bucket="a"} 9.0\n')
    assert parse_load(text) == {"waiting": 3.0, "running": 2.0, "kv_usage": 0.5}


def test_prefix_affinity_with_bounded_load():
    urls = [f"http://r{i}" for i in range(3)]
    reps = [Replica(u, ready=True) for u in urls]
    b = Balancer("prefix", load_factor=1.25)
    b.set_urls(urls)
    doc = "a shared system prompt " * 20
    k1, k2 = prefix_key(doc + "question one", 256), prefix_key(doc + "question two?", 256)
    assert k1 == k2 and prefix_key("short", 256) is None
    first = b.choose(reps, k1, set())
    assert b.choose(reps, k2, set()) is first  # same prefix, same replica
    first.inflight = 10  # a hot prefix spills over to a ring neighbour instead of queueing
    assert b.choose(reps, k1, set()) is not first
    assert b.choose(reps, k1, {first.url}) is not first
    first.inflight = 0
    reps[0].inflight = 5
    assert b.choose(reps, None, set()) is not reps[0]  # no affinity key: least loaded


def test_a_burst_after_a_batch_spreads_although_the_probes_are_stale():
    """The last probe saw a batch running on one replica; that batch has since ended through this router. The next
    burst must still spread evenly over both, not pile onto the other until the next probe."""
    busy, idle = Replica("http://busy", ready=True), Replica("http://idle", ready=True)
    busy.running, busy.waiting, busy.inflight = 4.0, 1.0, 5
    for _ in range(5):
        busy.ended()
    assert (busy.inflight, busy.running, busy.waiting, busy.load()) == (0, 0.0, 0.0, 0.0)
    b = Balancer("least-load")
    for _ in range(10):
        b.choose([busy, idle], None, set()).inflight += 1
    assert (busy.inflight, idle.inflight) == (5, 5)
    other = Replica("http://shared", ready=True, running=3.0, inflight=1)  # two of its three are another router's
    other.ended()
    assert other.load() == 2.0


def test_ring_moves_only_the_removed_replicas_keys():
    keys = [prefix_key(f"prompt {i} " * 40, 256) for i in range(300)]
    full, less = Ring(["a", "b", "c", "d"]), Ring(["a", "b", "c"])
    before = {k: next(full.walk(k)) for k in keys}
    after = {k: next(less.walk(k)) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "d")
    assert 40 < sum(v == "d" for v in before.values()) < 110  # roughly a quarter


def test_kubernetes_lister_with_a_fake_api(monkeypatch):
    import kubernetes

    from slofleet.router.replicas import ReplicaSet, kubernetes_lister, llmservice_selector

    selector = "slofleet.dev/service=chat,slofleet.dev/role in (unified,prefill,decode)"
    assert llmservice_selector("chat") == selector  # the router's own Service (role router) is not a replica

    class FakeDiscovery:
        slices = [{"metadata": {"labels": {"slofleet.dev/role": "decode"}}, "ports": [{"name": "http", "port": 8000}],
                   "endpoints": [{"addresses": ["10.0.0.1"]}]}]

        def list_namespaced_endpoint_slice(self, namespace, label_selector):
            assert (namespace, label_selector) == ("llm", selector)
            return type("List", (), {"items": self.slices})()

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "DiscoveryV1Api", FakeDiscovery)
    lister = kubernetes_lister("llm", selector, "http")
    changes = []
    rs = ReplicaSet(lister=lister, on_change=changes.append)
    rs.set_urls(lister())
    assert list(rs.replicas) == ["http://10.0.0.1:8000"] and changes == [["http://10.0.0.1:8000"]]
    rs.replicas["http://10.0.0.1:8000"].ready = True
    FakeDiscovery.slices.append({"metadata": {"labels": {"slofleet.dev/role": "prefill"}},
                                 "ports": [{"name": "http", "port": 8000}], "endpoints": [{"addresses": ["10.0.0.2"]}]})
    rs.set_urls(lister())
    assert changes[-1] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert rs.replicas["http://10.0.0.1:8000"].ready  # a known replica keeps its state
    assert [r.role for r in rs.replicas.values()] == ["decode", "prefill"]
    rs.replicas["http://10.0.0.2:8000"].ready = True
    assert [r.url for r in rs.ready(("prefill",))] == ["http://10.0.0.2:8000"]


def test_a_slow_probe_is_not_a_dead_replica_but_a_refused_one_is():
    from .helpers import StandIn

    standin = StandIn()

    async def scenario() -> None:
        rs = ReplicaSet(static={standin.url: "unified"})
        r = rs.replicas[standin.url]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as client:
            await rs.probe(client, r)
            assert r.ready
            standin.probe_delay = 1.0  # busy: /ready answers after the probe's timeout
            for _ in range(rs.slow_limit - 1):
                await rs.probe(client, r)
                assert r.ready  # late answers alone do not take it out...
            await rs.probe(client, r)
            assert not r.ready  # ...until slow_limit of them in a row
            standin.probe_delay = 0.0
            await rs.probe(client, r)
            assert r.ready and r.slow_probes == 0
            standin.stop()
            await rs.probe(client, r)
            assert not r.ready  # a refused connection takes it out at once

    asyncio.run(scenario())
