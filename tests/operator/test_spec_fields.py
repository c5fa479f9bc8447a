"""Every field of LLMService and SLOPolicy acts as its description says: the table below names, per field (found by
walking the pydantic models), the test that sets a non-default value and asserts an effect absent at the default.
A new field without a row fails here, and so does a row whose test is gone."""
from __future__ import annotations

import importlib
import types
import typing

import pytest
from pydantic import BaseModel

from slofleet.api.v1alpha1 import LLMServiceSpec, SLOPolicySpec, to_camel

LOGIC = "tests/operator/test_reconcile_logic.py"
FLAGS = "tests/operator/test_engine_flags.py::test_a_non_default_value_reaches_its_flag"
ROUTER = "tests/operator/test_router_spec.py"
ROUTING = "tests/router/test_units.py::test_classify_from_an_llmservice"
ASKS = "tests/router/test_bucket_rules.py::test_buckets_select_on_tools_and_structured_outputs"
DECIDE = "tests/autoscaler/test_spec_decisions.py"
STATUS = "tests/autoscaler/test_attainment.py"
GATEWAY = "tests/operator/test_gateway.py"

FIELDS = {
    "model.name": f"{LOGIC}::test_model_sources",
    "model.source": f"{LOGIC}::test_model_sources",
    "model.pvcName": f"{LOGIC}::test_model_sources",
    "model.path": f"{LOGIC}::test_model_sources",
    "model.initImage": f"{LOGIC}::test_model_sources",
    "model.initCommand": f"{LOGIC}::test_model_sources",
    "model.servedName": "tests/operator/test_model_name.py::test_served_name_wins",
    "engine.runtime": "tests/operator/test_runtimes.py::test_vllm_pod_takes_the_shared_settings_as_its_flags",
    "engine.image": f"{LOGIC}::test_image_env_probes_and_drain",
    "engine.imagePullPolicy": f"{LOGIC}::test_image_env_probes_and_drain",
    "engine.port": f"{LOGIC}::test_engine_fields_become_serve_flags",
    "engine.resources.requests": f"{LOGIC}::test_resources_and_gpus",
    "engine.resources.limits": f"{LOGIC}::test_resources_and_gpus",
    "engine.gpus": f"{LOGIC}::test_resources_and_gpus",
    "engine.dtype": f"{FLAGS}[dtype]",
    "engine.blockSize": f"{FLAGS}[block_size]",
    "engine.kvCacheMemoryGb": f"{FLAGS}[kv_cache_memory_gb]",
    "engine.maxNumSeqs": f"{FLAGS}[max_num_seqs]",
    "engine.maxNumBatchedTokens": f"{FLAGS}[max_num_batched_tokens]",
    "engine.maxModelLen": f"{FLAGS}[max_model_len]",
    "engine.enablePrefixCaching": f"{FLAGS}[enable_prefix_caching]",
    "engine.maxWaitingRequests": f"{FLAGS}[max_waiting_requests]",
    "engine.maxQueuedTokens": f"{FLAGS}[max_queued_tokens]",
    "engine.numSpeculativeTokens": f"{FLAGS}[num_speculative_tokens]",
    "engine.speculativeNgram": f"{FLAGS}[speculative_ngram]",
    "engine.startupSeconds": f"{LOGIC}::test_image_env_probes_and_drain",
    "engine.drainSeconds": f"{DECIDE}::test_drain_seconds_is_the_time_a_scale_down_must_fit_in",
    "engine.pricePerHour": f"{FLAGS}[price_per_hour]",
    "engine.env": f"{LOGIC}::test_image_env_probes_and_drain",
    "engine.args": "tests/operator/test_engine_flags.py::test_args_pass_through_for_flags_the_schema_does_not_name",
    "topology.mode": f"{LOGIC}::test_disaggregated_topology_has_a_deployment_and_service_per_role",
    "topology.unified.minReplicas": f"{LOGIC}::test_replicas_follow_one_writer_and_the_bounds",
    "topology.unified.maxReplicas": f"{LOGIC}::test_autoscaler_decision_from_status_is_clamped_into_the_deployment",
    "topology.unified.replicas": f"{LOGIC}::test_replicas_follow_one_writer_and_the_bounds",
    "topology.prefill.minReplicas": f"{LOGIC}::test_disaggregated_topology_has_a_deployment_and_service_per_role",
    "topology.prefill.maxReplicas": "tests/autoscaler/test_actuate.py::"
                                    "test_settings_take_bounds_timing_and_slos_from_the_resource",
    "topology.prefill.replicas": f"{LOGIC}::test_replicas_follow_one_writer_and_the_bounds",
    "topology.decode.minReplicas": "tests/autoscaler/test_actuate.py::"
                                   "test_settings_take_bounds_timing_and_slos_from_the_resource",
    "topology.decode.maxReplicas": "tests/autoscaler/test_actuate.py::"
                                   "test_settings_take_bounds_timing_and_slos_from_the_resource",
    "topology.decode.replicas": f"{LOGIC}::test_disaggregated_topology_has_a_deployment_and_service_per_role",
    "topology.prefillThresholdTokens": f"{LOGIC}::test_the_router_is_deployed_in_front_of_the_engines",
    "policyRef": "tests/k8s/test_operator.py::test_disaggregated_service_and_operator_restart",
    "buckets[].name": ROUTING,
    "buckets[].priority": "tests/router/test_gateway.py::test_bucket_priority_and_tpot_target_reach_the_engine",
    "buckets[].match.minPromptTokens": ROUTING,
    "buckets[].match.maxPromptTokens": ROUTING,
    "buckets[].match.maxOutputTokens": ROUTING,
    "buckets[].match.header": ROUTING,
    "buckets[].match.route": ROUTING,
    "buckets[].match.tools": ASKS,
    "buckets[].match.structured": ASKS,
    "buckets[].slo.percentile": f"{DECIDE}::test_each_bucket_is_judged_at_its_own_percentile",
    "buckets[].slo.ttftMs": f"{STATUS}::test_few_requests_in_several_buckets_each_get_their_figures",
    "buckets[].slo.tpotMs": f"{DECIDE}::test_a_bucket_over_its_tpot_target_is_a_miss",
    "buckets[].slo.e2eMs": f"{DECIDE}::test_a_bucket_missing_only_its_e2e_target_counts",
    "buckets[].admission.maxWaitingRequests": "tests/router/test_units.py::test_admission_limits_and_shedding_order",
    "buckets[].admission.maxQueuedTokens": "tests/router/test_bucket_rules.py::test_the_queued_tokens_limit",
    "buckets[].admission.maxRequestsPerSecond": "tests/router/test_units.py::test_requests_per_second_limit",
    "buckets[].admission.mode": "tests/router/test_admission.py::test_modes_decide_who_the_prediction_refuses",
    "autoscaling.enabled": f"{LOGIC}::test_replicas_follow_one_writer_and_the_bounds",
    "autoscaling.signals": f"{DECIDE}::test_signals_name_what_adds_replicas",
    "autoscaling.intervalSeconds": "tests/autoscaler/test_actuate.py::"
                                   "test_settings_take_bounds_timing_and_slos_from_the_resource",
    "autoscaling.scaleUpStabilizationSeconds": "tests/autoscaler/test_actuate.py::"
                                               "test_settings_take_bounds_timing_and_slos_from_the_resource",
    "autoscaling.scaleDownStabilizationSeconds": "tests/autoscaler/test_actuate.py::"
                                                 "test_settings_take_bounds_timing_and_slos_from_the_resource",
    "autoscaling.targetKvCacheUsage": "tests/autoscaler/test_actuate.py::"
                                      "test_settings_take_bounds_timing_and_slos_from_the_resource",
    "router.enabled": f"{LOGIC}::test_the_router_is_deployed_in_front_of_the_engines",
    "router.replicas": f"{LOGIC}::test_the_router_is_deployed_in_front_of_the_engines",
    "router.port": f"{LOGIC}::test_the_router_is_deployed_in_front_of_the_engines",
    "router.policy": f"{LOGIC}::test_the_router_is_deployed_in_front_of_the_engines",
    "router.holdTimeoutSeconds": f"{LOGIC}::test_the_router_is_deployed_in_front_of_the_engines",
    "router.resources.requests": f"{ROUTER}::test_router_resources",
    "router.resources.limits": f"{ROUTER}::test_router_resources",
    "router.image": "tests/operator/test_images.py::test_engine_pods_run_the_engine_image_and_routers_what_their_"
                    "policy_needs",
    "router.auth.secretName": f"{ROUTER}::test_auth_mounts_the_secret_and_names_its_key_and_default_quotas",
    "router.auth.key": f"{ROUTER}::test_auth_mounts_the_secret_and_names_its_key_and_default_quotas",
    "router.auth.requestsPerMinute": f"{ROUTER}::test_auth_mounts_the_secret_and_names_its_key_and_default_quotas",
    "router.auth.tokensPerMinute": f"{ROUTER}::test_auth_mounts_the_secret_and_names_its_key_and_default_quotas",
    "network.gatewayNamespace": "tests/operator/test_trust.py::"
                                "test_a_gateway_namespace_and_the_autoscalers_namespace_are_let_in",
    "network.endpointPicker.name": f"{GATEWAY}::test_one_inference_pool_over_the_pods_that_serve_requests",
    "network.endpointPicker.port": f"{GATEWAY}::test_one_inference_pool_over_the_pods_that_serve_requests",
    "network.endpointPicker.failureMode": f"{GATEWAY}::test_one_inference_pool_over_the_pods_that_serve_requests",
    # An SLOPolicy's buckets are the same Bucket model, field by field as above; what the policy adds is that a
    # service naming it in policyRef gets them.
    "SLOPolicy buckets": "tests/k8s/test_operator.py::test_disaggregated_service_and_operator_restart",
}


def model_of(annotation) -> tuple[type[BaseModel] | None, str]:
    """The model a field holds (through Optional and list), and '[]' for a list of them."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return model_of(next(a for a in args if a is not type(None)))
    if typing.get_origin(annotation) is list:
        inner, _ = model_of(args[0])
        return inner, "[]" if inner else ""
    return (annotation, "") if isinstance(annotation, type) and issubclass(annotation, BaseModel) else (None, "")


def leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        inner, suffix = model_of(f.annotation)
        path = prefix + to_camel(name) + suffix
        out += leaves(inner, path + ".") if inner else [path]
    return out


def test_every_spec_field_has_a_row_and_every_row_a_field():
    # An SLOPolicy holds buckets only, of the LLMService's own model: its fields are the rows above.
    assert set(SLOPolicySpec.model_fields) == {"buckets"} and set(leaves(SLOPolicySpec)) <= set(leaves(LLMServiceSpec))
    fields = set(leaves(LLMServiceSpec)) | {"SLOPolicy buckets"}
    assert fields - set(FIELDS) == set(), "fields without a test in the table"
    assert set(FIELDS) - fields == set(), "rows for fields that do not exist"


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_each_row_names_a_test_that_exists(field):
    path, _, name = FIELDS[field].partition("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    func, _, param = name.partition("[")
    test = getattr(module, func, None)
    assert callable(test), f"{FIELDS[field]} is no test"
    if param:  # a parametrized case: the parameter is one of the test's
        marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
        assert any(param.rstrip("]") in m.args[1] for m in marks), f"{FIELDS[field]}: no such case"
