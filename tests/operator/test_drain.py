"""Lossless scale-down without a cluster: which pods go, when the Deployment's count may drop, and what the operator
writes on the pods and asks of the engines meanwhile (stand-in Kube and engines)."""
from __future__ import annotations

import pytest

from slofleet.api.v1alpha1 import LLMService
from slofleet.operator import children, drain, engines, reconcile
from slofleet.operator.drain import DELETION_COST, DRAINING, plan


def pod(name: str, drained: bool = False, ip: str = "10.0.0.1") -> dict:
    notes = {DRAINING: "2026-01-01T00:00:00Z"} if drained else {}
    return {"metadata": {"name": name, "annotations": notes, "labels": {"slofleet.dev/role": "unified"}},
            "status": {"podIP": ip}}


def test_the_least_loaded_pod_is_drained_and_the_count_held_until_it_is_empty():
    pods = [pod("a"), pod("b")]
    p = plan(2, 1, pods, {"a": 5.0, "b": 3.0}, {})
    assert (p.replicas, p.drain, p.waiting) == (2, ["b"], True)  # held at 2 while b's 3 requests run
    assert p.costs == {"a": 5, "b": -1}  # the ReplicaSet deletes the lowest cost first: b
    p = plan(2, 1, [pod("a"), pod("b", drained=True)], {"a": 9.0, "b": 1.0}, {"b": 30.0})
    assert (p.replicas, p.drain, p.waiting) == (2, ["b"], True)  # a drain in progress is not moved to a
    p = plan(2, 1, [pod("a"), pod("b", drained=True)], {"a": 9.0, "b": 0.0}, {"b": 40.0})
    assert (p.replicas, p.drain, p.waiting) == (1, ["b"], False)  # empty: now the count drops


def test_unknown_load_and_a_drain_past_its_limit_do_not_hold_the_count():
    assert plan(2, 1, [pod("a"), pod("b")], {"a": None, "b": None}, {}).replicas == 1
    late = plan(2, 1, [pod("a"), pod("b", drained=True)], {"a": 0.0, "b": 4.0}, {"b": drain.DRAIN_LIMIT_SECONDS + 1})
    assert (late.replicas, late.waiting) == (1, False)


def test_drained_pods_stay_drained_until_removed_and_resume_when_wanted_again():
    after = plan(1, 1, [pod("a"), pod("b", drained=True)], {}, {})  # lowered, the ReplicaSet not there yet
    assert (after.replicas, after.resume) == (1, [])
    up = plan(1, 2, [pod("a"), pod("b", drained=True)], {}, {})  # scaled back up: b serves again
    assert (up.replicas, up.resume) == (2, ["b"])
    assert plan(None, 2, [], {}, {}) == drain.Plan(2)  # a new Deployment


class StandInKube:
    def __init__(self):
        self.notes: list[tuple[str, dict]] = []

    def annotate_pod(self, namespace: str, name: str, annotations: dict) -> None:
        self.notes.append((name, annotations))


def test_reconcile_drains_through_the_engines_and_annotates_the_pods(monkeypatch):
    calls = []
    loads = {"http://10.0.0.1:8000": 2.0, "http://10.0.0.2:8000": 0.0}
    monkeypatch.setattr(engines, "in_flight", lambda url, runtime: loads[url])
    monkeypatch.setattr(engines, "set_draining", lambda url, token, on: calls.append((url, token, on)))
    svc = LLMService.model_validate({"metadata": {"name": "s", "namespace": "ns", "uid": "u"},
                                     "spec": {"topology": {"unified": {"minReplicas": 1, "maxReplicas": 3,
                                                                       "replicas": 1}}}})
    wanted = children.desired(svc, children.Inputs([], "tok"))
    existing = {("Deployment", "s-unified"): {"spec": {"replicas": 2}}}
    pods = {"unified": [pod("a", ip="10.0.0.1"), pod("b", ip="10.0.0.2")]}
    kube = StandInKube()
    assert not reconcile.scale_down_losslessly(kube, svc, wanted, existing, pods, "tok")
    dep = next(d for d in wanted if d["metadata"]["name"] == "s-unified")
    assert dep["spec"]["replicas"] == 1  # b was idle: no wait
    assert calls == [("http://10.0.0.2:8000", "tok", True)]
    notes = dict(kube.notes)
    assert notes["a"] == {DELETION_COST: "2"} and notes["b"][DELETION_COST] == "-1" and notes["b"][DRAINING]


LLAMA = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 4\nvllm:num_requests_running 9\n"


@pytest.mark.parametrize("load,runtime,expected", [
    ("vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n", "slofleet", 3.0),
    ("vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n", "vllm", 3.0),
    (LLAMA, "llamacpp", 6.0),  # each runtime under its own names (contract.RUNTIME_METRICS)
    ("not metrics {", "slofleet", None)])
def test_in_flight_reads_the_engine_gauges(monkeypatch, load, runtime, expected):
    class Answer:
        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

        def read(self):
            return load.encode()

    monkeypatch.setattr(engines.urllib.request, "urlopen", lambda url, timeout: Answer())
    assert engines.in_flight("http://x", runtime) == expected
    assert engines.in_flight(None, runtime) is None
