"""One builder of a pod's URL (contract.pod_url) for the operator (draining engines) and the autoscaler (scraping
engines and routers): the same address from the pod the operator writes, whether the port is given or read."""
from __future__ import annotations

from slofleet.api.contract import DEFAULT_ENGINE_PORT, pod_url
from slofleet.api.v1alpha1 import LLMService
from slofleet.operator.podspec import ports


def pod(ip: str | None, *container_ports: dict) -> dict:
    return {"spec": {"containers": [{"name": "engine", "ports": list(container_ports)}]},
            "status": {"podIP": ip} if ip else {}}


def test_the_engine_pod_the_operator_writes_answers_at_its_spec_port():
    svc = LLMService.model_validate({"metadata": {"name": "x"},
                                     "spec": {"engine": {"port": 9123}, "router": {"policy": "precise"}}})
    written = pod("10.0.0.7", *ports(svc))  # the KV event ports beside the HTTP one
    assert pod_url(written) == pod_url(written, svc.spec.engine.port) == "http://10.0.0.7:9123"


def test_the_port_named_http_wins_then_the_first_then_the_default():
    assert pod_url(pod("10.0.0.1", {"name": "zmq", "containerPort": 5557}, {"name": "http", "containerPort": 81})) \
        == "http://10.0.0.1:81"
    assert pod_url(pod("10.0.0.1", {"name": "web", "containerPort": 82})) == "http://10.0.0.1:82"
    assert pod_url(pod("10.0.0.1")) == f"http://10.0.0.1:{DEFAULT_ENGINE_PORT}"
    assert pod_url({"status": {"podIP": "10.0.0.1"}}, 7) == "http://10.0.0.1:7"


def test_a_pod_without_an_ip_has_no_url():
    assert pod_url(pod(None, {"name": "http", "containerPort": 80})) is None
    assert pod_url({"metadata": {"name": "pending"}}, 80) is None
