"""An existing gateway in front of the engines (issue #16 item 3), without an API server: the InferencePool per
serving role, made only where its CRD exists; the engines' token rule with the router off; the engine's guard under
it (vllm:cache_config_info, for the endpoint picker, is read off a real engine in
tests/engine/test_kv_events_engine.py)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from slofleet.engine.config import EngineConfig
from slofleet.engine.server.api import build_app
from slofleet.engine.server.settings import ServerSettings
from tests.operator.test_trust import DISAGG, OWNER, build, containers, svc

PICKER = {"name": "epp", "port": 9003, "failureMode": "FailOpen"}  # both not the default


def test_one_inference_pool_over_the_pods_that_serve_requests():
    objs = build(svc({"network": {"endpointPicker": PICKER}}), inference_pool=True)
    [name] = [k for k in objs if k.startswith("InferencePool/")]
    pool = objs[name]
    assert name == "InferencePool/s-unified" and pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["ownerReferences"] == OWNER and pool["metadata"]["namespace"] == "ns"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"slofleet.dev/service": "s", "slofleet.dev/role": "unified"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"group": "", "kind": "Service", "name": "epp", "port": {"number": 9003},
                              "failureMode": "FailOpen"}}
    # The selector is the engine Deployment's own: the pool holds exactly its pods.
    assert pool["spec"]["selector"]["matchLabels"] == objs["Deployment/s-unified"]["spec"]["selector"]["matchLabels"]

    # Disaggregated: the decode engines answer clients (the prefill ones only the decode engines), on their port.
    objs = build(svc({"topology": DISAGG, "engine": {"port": 9100}}), inference_pool=True)
    pools = [o for k, o in objs.items() if k.startswith("InferencePool/")]
    assert [p["metadata"]["name"] for p in pools] == ["s-decode"]
    decode = {"slofleet.dev/service": "s", "slofleet.dev/role": "decode"}
    assert pools[0]["spec"] == {"selector": {"matchLabels": decode}, "targetPorts": [{"number": 9100}]}  # no picker
    # Where the CRD does not exist, no pool.
    assert not [k for k in build(svc()) if k.startswith("InferencePool/")]


def test_endpoint_picker_fields_are_checked():
    picker = svc({"network": {"endpointPicker": {"name": "epp"}}}).spec.network.endpoint_picker
    assert (picker.port, picker.failure_mode) == (9002, "FailClose")  # the inference extension's EPP defaults
    for bad in ({"port": 9002}, {"name": "epp", "port": 0}, {"name": "epp", "failureMode": "Open"}, {"name": "Epp"}):
        with pytest.raises(ValidationError):
            svc({"network": {"endpointPicker": bad}})


@pytest.mark.parametrize(("router", "gateway", "token_free"), [
    (True, "gw", False),  # the router is the way in: the engines keep requiring the token
    (False, None, False),  # no gateway named: nothing but the service's own pods should call the engines
    (False, "gw", True)])
def test_engines_take_the_gateways_requests_without_the_token_only_in_the_routers_place(router, gateway, token_free):
    spec = {"router": {"enabled": router}, **({"network": {"gatewayNamespace": gateway}} if gateway else {})}
    for c in containers(build(svc(spec))).values():
        assert ("--no-require-internal-token" in c["args"]) is token_free


def test_the_engine_guard_opens_the_generation_endpoints_only():
    def status(settings: ServerSettings, method: str, path: str, **kw) -> int:
        # Not entered: no lifespan, no model; past the guard, a request gets 503 (loading) or its own refusal.
        return TestClient(build_app(EngineConfig(), settings)).request(method, path, **kw).status_code

    strict, gateway = ServerSettings(internal_token="tok"), ServerSettings(internal_token="tok",
                                                                           require_internal_token=False)
    body = {"json": {"model": "m", "prompt": "hi"}}
    assert status(strict, "POST", "/v1/completions", **body) == 401
    assert status(gateway, "POST", "/v1/completions", **body) == 503
    assert status(gateway, "GET", "/v1/models") == 503
    assert status(gateway, "POST", "/v1/kv/prefill", json={"prompt_token_ids": [1], "sampling": {}}) == 401
    assert status(gateway, "POST", "/v1/drain") == 401
    assert status(gateway, "GET", "/debug/traces") == 401
    auth = {"headers": {"Authorization": "Bearer tok"}}
    assert status(gateway, "POST", "/v1/kv/prefill", json={"prompt_token_ids": [1], "sampling": {}}, **auth) == 503
    # An API key, where one is set, is still asked of everyone.
    keyed = ServerSettings(internal_token="tok", require_internal_token=False, api_key="k")
    assert status(keyed, "POST", "/v1/completions", **body) == 401
    assert status(keyed, "POST", "/v1/completions", headers={"Authorization": "Bearer k"}, **body) == 503

