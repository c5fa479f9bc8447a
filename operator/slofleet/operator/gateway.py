"""Pure: what lets an existing Gateway API gateway front the engines: an InferencePool (the Gateway API Inference
Extension's, inference.networking.k8s.io/v1) over the pods of the role that serves requests, made where its CRD
exists (the engines' token rule for a gateway in the router's place is podspec.serve_args').

The pool selects the engine pods of one LLMService role (unified, or decode: a prefill engine answers no client) on
the engine port, names spec.network.endpointPicker as its endpointPickerRef, and is owned by the LLMService, so it
goes with it. A gateway's HTTPRoute points at the pool; its endpoint picker reads the engines' vLLM metrics
(vllm:num_requests_waiting, vllm:kv_cache_usage_perc, vllm:cache_config_info) on the same port.
"""
from __future__ import annotations

from slofleet.api.contract import DECODE, ROLE_LABEL, SERVICE_LABEL, UNIFIED
from slofleet.api.v1alpha1 import LLMService
from slofleet.operator.podspec import labels

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"


def serving_role(svc: LLMService) -> str:
    return UNIFIED if svc.spec.topology.mode == "unified" else DECODE


def inference_pool(svc: LLMService, owner: dict) -> dict:
    name, role = svc.metadata["name"], serving_role(svc)
    spec: dict = {"selector": {"matchLabels": {SERVICE_LABEL: name, ROLE_LABEL: role}},
                  "targetPorts": [{"number": svc.spec.engine.port}]}
    picker = svc.spec.network.endpoint_picker
    if picker is not None:
        spec["endpointPickerRef"] = {"group": "", "kind": "Service", "name": picker.name,
                                     "port": {"number": picker.port}, "failureMode": picker.failure_mode}
    return {"apiVersion": INFERENCE_POOL_API, "kind": "InferencePool",
            "metadata": {"name": f"{name}-{role}", "namespace": svc.metadata.get("namespace", "default"),
                         "labels": labels(name, role), "ownerReferences": [owner]},
            "spec": spec}
