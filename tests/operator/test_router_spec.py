"""spec.router.auth and the buckets' admission limits across router replicas, from the resource to the router's pod,
its policy.json and the status; and the engine settings the CRD refuses (more than one GPU)."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from slofleet.api.v1alpha1 import GPUS_MESSAGE, LLMService
from slofleet.operator import children, status
from slofleet.operator.podspec import DRAIN_DELAY_SECONDS, DRAIN_SLACK_SECONDS
from tests.operator.test_reconcile_logic import arg, build, svc

DOC = {"name": "doc", "slo": {"ttftMs": 4000}, "admission": {"maxWaitingRequests": 16, "maxQueuedTokens": 65536,
                                                              "maxRequestsPerSecond": 3}}


def router(objs: dict) -> tuple[dict, dict]:
    pod = objs["Deployment/s-router"]["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_auth_mounts_the_secret_and_names_its_key_and_default_quotas():
    objs = build(svc({"router": {"auth": {"secretName": "api-keys", "key": "list", "requestsPerMinute": 60,
                                          "tokensPerMinute": 20000}}}))
    pod, c = router(objs)
    assert {"name": "auth", "secret": {"secretName": "api-keys"}} in pod["volumes"]
    assert {"name": "auth", "mountPath": "/etc/slofleet-auth", "readOnly": True} in c["volumeMounts"]
    assert [arg(c, f) for f in ("--api-keys-file", "--rpm", "--tpm")] == ["/etc/slofleet-auth/list", "60", "20000"]
    # The router re-reads the file (a kubelet updates a mounted Secret in place): a new key rolls nothing.
    assert objs["Deployment/s-router"]["spec"]["template"]["metadata"] == \
        build(svc())["Deployment/s-router"]["spec"]["template"]["metadata"]


def test_without_auth_the_router_needs_no_key():
    pod, c = router(build(svc()))
    assert "--api-keys-file" not in c["args"] and "--rpm" not in c["args"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp", "config"]


def test_router_resources():
    _, c = router(build(svc({"router": {"resources": {"requests": {"cpu": "250m"}, "limits": {"memory": "1Gi"}}}})))
    assert c["resources"] == {"requests": {"cpu": "250m"}, "limits": {"memory": "1Gi"}}
    _, default = router(build(svc()))
    assert default["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"},
                                    "limits": {"cpu": "1", "memory": "512Mi"}}


def test_admission_limits_are_divided_among_the_router_replicas_and_shown_in_status():
    s = svc({"buckets": [DOC, {"name": "chat", "slo": {"ttftMs": 500}}], "router": {"replicas": 3}})
    policy = json.loads(build(s)["ConfigMap/s-engine"]["data"]["policy.json"])
    assert policy["buckets"][0]["admission"] == {"maxWaitingRequests": 5, "maxQueuedTokens": 21845,
                                                 "maxRequestsPerSecond": 1.0, "mode": "slo-predicted"}
    assert policy["buckets"][1]["admission"] == {"mode": "slo-predicted"}
    shown = [a.wire() for a in children.router_admission(s, s.spec.buckets)]
    assert shown == [{"name": "doc", **{k: v for k, v in policy["buckets"][0]["admission"].items() if k != "mode"}}]
    assert status.status_patch({}, 1, "e", [], "t", [], shown)["routerAdmission"] == shown
    # One router holds the whole limit; a limit smaller than the replicas still admits one per router.
    one = svc({"buckets": [DOC]})
    assert json.loads(build(one)["ConfigMap/s-engine"]["data"]["policy.json"])["buckets"][0]["admission"] == \
        {"maxWaitingRequests": 16, "maxQueuedTokens": 65536, "maxRequestsPerSecond": 3.0, "mode": "slo-predicted"}
    tiny = svc({"buckets": [{**DOC, "admission": {"maxWaitingRequests": 1}}], "router": {"replicas": 4}})
    assert children.router_admission(tiny, tiny.spec.buckets)[0].max_waiting_requests == 1


def test_each_bucket_s_admission_mode_is_rendered_for_the_router():
    """SLO-predicted by default where there is a TTFT target, fixed where there is none; a mode set stays."""
    s = svc({"buckets": [{"name": "chat", "slo": {"ttftMs": 500}},
                         {"name": "batch", "priority": 5, "match": {"header": {"x-tier": "batch"}},
                          "slo": {"e2eMs": 60000}},
                         {"name": "bulk", "priority": 9, "match": {"route": "/v1/completions"},
                          "slo": {"ttftMs": 9000}, "admission": {"mode": "off"}}]})
    policy = json.loads(build(s)["ConfigMap/s-engine"]["data"]["policy.json"])
    assert [b["admission"]["mode"] for b in policy["buckets"]] == ["slo-predicted", "fixed", "off"]
    with pytest.raises(ValidationError, match="mode"):
        LLMService.model_validate({"spec": {"buckets": [{"name": "x", "slo": {"ttftMs": 1},
                                                         "admission": {"mode": "sometimes"}}]}})


def test_more_than_one_gpu_is_refused_with_what_to_do():
    with pytest.raises(ValidationError, match="gpus > 1 is not supported"):
        LLMService.model_validate({"spec": {"engine": {"gpus": 2}}})
    assert "more replicas" in GPUS_MESSAGE
    assert LLMService.model_validate({"spec": {"engine": {"gpus": 1}}}).spec.engine.gpus == 1


def test_the_sigterm_sequence_ends_before_the_kubelets_sigkill():
    s = svc({"engine": {"drainSeconds": 7}})
    objs = build(s)
    for name, flag in (("Deployment/s-unified", "--grace-period"), ("Deployment/s-router", "--grace-period")):
        pod = objs[name]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert float(arg(c, flag)) == 7 and float(arg(c, "--drain-delay")) == DRAIN_DELAY_SECONDS
        assert DRAIN_DELAY_SECONDS + 7 < pod["terminationGracePeriodSeconds"] == 7 + DRAIN_SLACK_SECONDS
