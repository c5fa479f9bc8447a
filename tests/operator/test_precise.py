"""spec.router.policy precise in the pod plans: the engines publish KV events on named ports, the router is told where
each replica it discovers publishes and loads the engines' model as they do, and only the router may reach those
ports. Every flag goes through the real `slofleet serve` / `slofleet router` parsers."""
from __future__ import annotations

import argparse

import kopf
import pytest

from slofleet.api.contract import KV_EVENTS_PORT, KV_REPLAY_PORT
from slofleet.engine.server import cli as serve_cli
from slofleet.operator import handlers, router
from slofleet.router import cli as router_cli
from slofleet.router.kv_index import PrefixIndex, Subscriptions
from slofleet.router.replicas import endpoints_from_slices
from tests.operator.test_reconcile_logic import arg, build, engine, svc
from tests.support.kube import StandInKube

MEMORY = {"requests": {"cpu": "100m", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}}
PRECISE = {"policy": "precise", "resources": MEMORY}
DISAGG = {"mode": "disaggregated", "prefill": {}, "decode": {}}


def parse(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def router_pod(objs: dict) -> tuple[dict, dict]:
    pod = objs["Deployment/s-router"]["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_the_router_subscribes_where_each_discovered_engine_publishes():
    objs = build(svc({"router": PRECISE}))
    e, (_, r) = engine(objs), router_pod(objs)
    served = parse(serve_cli.add_arguments, e["args"])
    assert (served.kv_events_endpoint, served.kv_events_replay_endpoint) == \
        (f"tcp://0.0.0.0:{KV_EVENTS_PORT}", f"tcp://0.0.0.0:{KV_REPLAY_PORT}")
    assert {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"} in e["ports"]
    assert {"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"} in e["ports"]
    # The router finds the pod through its Service's EndpointSlice (the http port), and subscribes at its address.
    routed = parse(router_cli.add_arguments, r["args"])
    assert routed.policy == "precise" and routed.model == served.model == "default"
    found = endpoints_from_slices([{"ports": [{"name": routed.k8s_port_name, "port": 8000}],
                                    "endpoints": [{"addresses": ["10.0.0.7"]}]}], routed.k8s_port_name)
    subs = Subscriptions(PrefixIndex(), routed.kv_events_endpoint, routed.kv_events_replay_endpoint)
    assert [subs.at(subs.endpoint, u) for u in found] == [f"tcp://10.0.0.7:{KV_EVENTS_PORT}"]
    assert [subs.at(subs.replay_endpoint, u) for u in found] == [f"tcp://10.0.0.7:{KV_REPLAY_PORT}"]


def test_other_policies_and_no_router_publish_nothing():
    for spec in ({}, {"router": {"policy": "least-load"}}, {"router": {**PRECISE, "enabled": False}}):
        objs = build(svc(spec))
        e = engine(objs)
        assert "--kv-events-endpoint" not in e["args"] and [p["name"] for p in e["ports"]] == ["http"]
        if "Deployment/s-router" in objs:
            pod, r = router_pod(objs)
            assert "--model" not in r["args"] and "startupProbe" not in r and "initContainers" not in pod
            assert [v["name"] for v in pod["volumes"]] == ["tmp", "config"]


def test_every_engine_role_publishes_in_a_disaggregated_service():
    objs = build(svc({"router": PRECISE, "topology": DISAGG}))
    for role in ("prefill", "decode"):
        assert arg(engine(objs, role), "--kv-events-endpoint") == f"tcp://0.0.0.0:{KV_EVENTS_PORT}"


@pytest.mark.parametrize("model", [
    {"source": "pvc", "pvcName": "weights", "path": "/weights", "name": "qwen"},
    {"source": "init", "initImage": "fetch:1", "initCommand": ["fetch", "/models"], "name": "qwen"},
])
def test_the_router_loads_the_engines_model_from_the_same_volume(model):
    objs = build(svc({"router": PRECISE, "model": model, "engine": {"startupSeconds": 600}}))
    e, engine_pod = engine(objs), objs["Deployment/s-unified"]["spec"]["template"]["spec"]
    pod, r = router_pod(objs)
    assert arg(r, "--model") == arg(e, "--model") == f"{model.get('path', '/models')}/qwen"
    assert [v for v in pod["volumes"] if v["name"] != "config"] == engine_pod["volumes"]
    assert [m for m in r["volumeMounts"] if m["name"] != "config"] == e["volumeMounts"]
    assert pod.get("initContainers") == engine_pod.get("initContainers")
    # Its scratch and model cache where the engines have theirs (a GGUF is converted there on the first start).
    assert {x["name"]: x.get("value") for x in r["env"]}.items() >= \
        {x["name"]: x.get("value") for x in e["env"] if x["name"] in ("HOME", "TMPDIR", "SLOFLEET_CACHE")}.items()
    # Loading the model comes before /health answers: liveness waits for it as for an engine.
    assert r["startupProbe"] == e["startupProbe"] | {"httpGet": {"path": "/health", "port": 8080}}


def test_the_router_hashes_with_the_engines_seed():
    objs = build(svc({"router": PRECISE, "engine": {"env": {"PYTHONHASHSEED": "7", "OTHER": "x"}}}))
    names = {x["name"]: x.get("value") for x in router_pod(objs)[1]["env"]}
    assert names["PYTHONHASHSEED"] == "7" and "OTHER" not in names
    assert "PYTHONHASHSEED" not in {x["name"] for x in router_pod(build(svc({"router": PRECISE})))[1]["env"]}


def test_only_the_router_reaches_the_event_ports():
    plain = build(svc(), network_policy=True)["NetworkPolicy/s-engine"]["spec"]["ingress"]
    ingress = build(svc({"router": PRECISE}), network_policy=True)["NetworkPolicy/s-engine"]["spec"]["ingress"]
    assert ingress[0] == plain[0] and len(plain) == 1
    assert ingress[1] == {"ports": [{"protocol": "TCP", "port": "kv-events"}, {"protocol": "TCP", "port": "kv-replay"}],
                          "from": [{"podSelector": {"matchLabels": {"slofleet.dev/service": "s",
                                                                    "slofleet.dev/role": "router"}}}]}


def test_a_router_memory_limit_too_small_for_the_model_is_warned_about():
    assert "at least 2Gi (it has 512Mi)" in router.memory_warning(svc({"router": {"policy": "precise"}}))
    for spec in ({"router": PRECISE}, {"router": {"policy": "precise", "resources": {"limits": {"memory": 3 << 30}}}},
                 {"router": {"policy": "precise", "resources": {"limits": {"cpu": "1"}}}}, {}):
        assert router.memory_warning(svc(spec)) is None


def test_the_warning_reaches_the_resource_as_an_event(monkeypatch):
    warned = []
    monkeypatch.setattr(handlers, "_kube", StandInKube())
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warned.append((reason, message)))
    monkeypatch.setattr(kopf, "info", lambda body, reason, message: None)
    body = {"apiVersion": "slofleet.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "s", "namespace": "ns", "uid": "uid-1", "generation": 1}}
    handlers.reconcile_once({**body, "spec": {"router": {"policy": "precise"}}}, "create")
    assert [r for r, _ in warned] == ["RouterMemoryLow"]
    handlers.reconcile_once({**body, "spec": {"router": PRECISE}}, "update")
    assert len(warned) == 1
