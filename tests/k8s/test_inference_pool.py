"""An existing gateway fronts the engines (issue #16 item 3), against the real API server: with the InferencePool CRD
installed, the operator makes one InferencePool for the role that serves requests, over that role's pods, naming the
endpoint picker; with the router off the engines take the gateway's requests without the token; and the pool goes
with the LLMService (garbage collection, kube-controller-manager)."""
from __future__ import annotations

import json
import time

import pytest

from tests.k8s.conftest import log, wait_until
from tests.k8s.test_operator import DISAGG, apply, operator  # noqa: F401 (operator: the fixture)

# STAND-IN, not the Gateway API Inference Extension's CRD: a schema written for these tests after the fields and
# rules of its published inference.networking.k8s.io/v1 InferencePool (v1.6.0: selector.matchLabels, targetPorts,
# optional endpointPickerRef with its defaults and its port rule, appProtocol), so that the API server checks and
# defaults what the operator writes as the real one would.
PORT = {"type": "object", "required": ["number"],
        "properties": {"number": {"type": "integer", "format": "int32", "minimum": 1, "maximum": 65535}}}
STAND_IN_SPEC = {
    "type": "object", "required": ["selector", "targetPorts"],
    "properties": {
        "appProtocol": {"type": "string", "default": "http", "enum": ["http", "kubernetes.io/h2c"]},
        "selector": {"type": "object", "required": ["matchLabels"], "properties": {"matchLabels": {
            "type": "object", "minProperties": 1, "maxProperties": 64,
            "additionalProperties": {"type": "string", "maxLength": 63}}}},
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT,
                        "x-kubernetes-validations": [{"rule": "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
                                                      "message": "port number must be unique"}]},
        "endpointPickerRef": {
            "type": "object", "required": ["name"],
            "properties": {"group": {"type": "string", "default": ""}, "kind": {"type": "string", "default": "Service"},
                           "name": {"type": "string", "minLength": 1, "maxLength": 253}, "port": PORT,
                           "failureMode": {"type": "string", "default": "FailClose",
                                           "enum": ["FailOpen", "FailClose"]}},
            "x-kubernetes-validations": [{"rule": "self.kind != 'Service' || has(self.port)",
                                          "message": "port is required when kind is 'Service' or unspecified"}]}}}
CRD = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
       # A *.k8s.io group needs this annotation; "unapproved" says the stand-in is no approved API.
       "metadata": {"name": "inferencepools.inference.networking.k8s.io",
                    "annotations": {"api-approved.kubernetes.io": "unapproved, a test stand-in"}},
       "spec": {"group": "inference.networking.k8s.io", "scope": "Namespaced",
                "names": {"kind": "InferencePool", "listKind": "InferencePoolList", "plural": "inferencepools",
                          "singular": "inferencepool"},
                "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                              "schema": {"openAPIV3Schema": {"type": "object", "required": ["spec"], "properties": {
                                  "spec": STAND_IN_SPEC,
                                  "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]}}
SPEC = {"engine": DISAGG["engine"], "topology": DISAGG["topology"], "router": {"enabled": False},
        "network": {"gatewayNamespace": "gw", "endpointPicker": {"name": "gw-epp"}}}


@pytest.fixture
def inference_pool_crd(crds):
    """Installed before the operator starts (it looks for the kind as it does for the ServiceMonitor's)."""
    crds.kubectl("apply", "-f", "-", input=json.dumps(CRD))
    crds.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD['metadata']['name']}")
    yield
    crds.kubectl("delete", "crd", CRD["metadata"]["name"], "--wait=false")


def test_inference_pool_per_serving_role_owned_by_the_service(crds, namespace, inference_pool_crd, operator):  # noqa: F811
    t0, ns = time.monotonic(), namespace
    apply(crds, ns, "pool", SPEC)
    pool = wait_until("the InferencePool", lambda: crds.get("inferencepool", "pool-decode", ns), timeout=60)
    assert [p["metadata"]["name"] for p in crds.items("inferencepool", ns)] == ["pool-decode"]  # not the prefill's
    uid = crds.get("llms", "pool", ns)["metadata"]["uid"]
    assert [(r["kind"], r["uid"], r["controller"]) for r in pool["metadata"]["ownerReferences"]] == \
        [("LLMService", uid, True)]
    # As the API server stored it, its defaults filled in.
    decode = {"slofleet.dev/service": "pool", "slofleet.dev/role": "decode"}
    picker = {"group": "", "kind": "Service", "name": "gw-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    assert pool["spec"] == {"selector": {"matchLabels": decode}, "targetPorts": [{"number": 8000}],
                            "appProtocol": "http", "endpointPickerRef": picker}
    # Its selector, asked of the API server, finds the decode engines' pods and no other.
    if crds.local:
        wait_until("the engine pods", lambda: len(crds.items("pods", ns, "slofleet.dev/service=pool")) == 2, timeout=60)
        selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
        assert [p["metadata"]["labels"]["slofleet.dev/role"] for p in crds.items("pods", ns, selector)] == ["decode"]
    # No router: the gateway calls the engines, without the internal token.
    args = crds.get("deployment", "pool-decode", ns)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--no-require-internal-token" in args and crds.get("deployment", "pool-router", ns) is None
    log(f"  InferencePool made: {time.monotonic() - t0:.1f}s")

    crds.kubectl("delete", "llms", "pool", "-n", ns)
    # The garbage collector watches a kind its CRD added only from its next discovery (about 30 s here).
    wait_until("the InferencePool collected", lambda: not crds.items("inferencepool", ns), timeout=90)
    log(f"  InferencePool garbage-collected: {time.monotonic() - t0:.1f}s")
