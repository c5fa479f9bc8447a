"""The pure reconcile logic: an LLMService spec -> the desired children and status, field by field."""
from __future__ import annotations

import json

import pytest

from slofleet.api.images import CONTROL_IMAGE
from slofleet.api.v1alpha1 import Bucket, LLMService, Pool, RoleAutoscaling
from slofleet.engine.config import EngineConfig
from slofleet.operator import children, status
from slofleet.operator.podspec import bucket_priorities

BUCKETS = [{"name": "chat", "priority": 0, "slo": {"ttftMs": 300}},
           {"name": "doc", "priority": 5, "match": {"minPromptTokens": 2000}, "slo": {"percentile": 90, "e2eMs": 9000}}]


def svc(spec: dict | None = None, status_: dict | None = None) -> LLMService:
    return LLMService.model_validate({"metadata": {"name": "s", "namespace": "ns", "uid": "uid-1", "generation": 3},
                                      "spec": spec or {}, "status": status_ or {}})


def build(s: LLMService, **inputs) -> dict[str, dict]:
    inputs.setdefault("buckets", s.spec.buckets)
    inputs.setdefault("internal_token", "t0k3n")
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in children.desired(s, children.Inputs(**inputs))}


def engine(objs: dict, role: str = "unified") -> dict:
    return objs[f"Deployment/s-{role}"]["spec"]["template"]["spec"]["containers"][0]


def arg(container: dict, flag: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1]


def test_unified_defaults_produce_the_expected_children():
    objs = build(svc())
    assert sorted(objs) == ["ConfigMap/s-engine", "Deployment/s-router", "Deployment/s-unified",
                            "PodDisruptionBudget/s", "RoleBinding/s-router", "Secret/s-internal-token",
                            "Service/s-router", "Service/s-unified", "ServiceAccount/s-router"]
    for o in objs.values():
        assert o["metadata"]["namespace"] == "ns"
        assert o["metadata"]["ownerReferences"] == [{"apiVersion": "slofleet.dev/v1alpha1", "kind": "LLMService",
                                                     "name": "s", "uid": "uid-1", "controller": True,
                                                     "blockOwnerDeletion": True}]
        assert o["metadata"]["labels"]["slofleet.dev/service"] == "s"
    d = objs["Deployment/s-unified"]["spec"]
    assert d["replicas"] == 1 and d["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert d["selector"]["matchLabels"] == {"slofleet.dev/service": "s", "slofleet.dev/role": "unified"}
    assert objs["Service/s-unified"]["spec"]["selector"] == d["selector"]["matchLabels"]
    assert objs["PodDisruptionBudget/s"]["spec"] == {"maxUnavailable": 1,
                                                     "selector": {"matchLabels": {"slofleet.dev/service": "s"}}}
    c = engine(objs)
    assert c["command"] == ["slofleet", "serve"] and arg(c, "--role") == "unified" and arg(c, "--model") == "default"
    assert arg(c, "--host") == "$(POD_IP)"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert "--bucket-priorities" not in c["args"]


def test_disaggregated_topology_has_a_deployment_and_service_per_role():
    objs = build(svc({"topology": {"mode": "disaggregated", "prefill": {"minReplicas": 2, "maxReplicas": 4},
                                   "decode": {"minReplicas": 1, "maxReplicas": 8, "replicas": 3}}}))
    assert sorted(objs) == ["ConfigMap/s-engine", "Deployment/s-decode", "Deployment/s-prefill", "Deployment/s-router",
                            "PodDisruptionBudget/s", "RoleBinding/s-router", "Secret/s-internal-token",
                            "Service/s-decode", "Service/s-prefill", "Service/s-router", "ServiceAccount/s-router"]
    assert objs["Deployment/s-prefill"]["spec"]["replicas"] == 2
    assert objs["Deployment/s-decode"]["spec"]["replicas"] == 3
    assert arg(engine(objs, "prefill"), "--role") == "prefill" and arg(engine(objs, "decode"), "--role") == "decode"
    assert children.endpoint(svc()) == "http://s-router.ns.svc:8080"
    # Without a router, clients call the engines that run whole requests (a decode engine prefills itself).
    assert children.endpoint(svc({"router": {"enabled": False}})) == "http://s-unified.ns.svc:8000"
    assert children.endpoint(svc({"router": {"enabled": False}, "topology": {
        "mode": "disaggregated", "prefill": {}, "decode": {}}})) == "http://s-decode.ns.svc:8000"


def test_the_router_is_deployed_in_front_of_the_engines():
    s = svc({"buckets": BUCKETS, "engine": {"image": "reg/x:1", "drainSeconds": 20},
             "topology": {"mode": "disaggregated", "prefill": {}, "decode": {}, "prefillThresholdTokens": 1024},
             "router": {"replicas": 2, "port": 9090, "holdTimeoutSeconds": 30, "policy": "least-load"}})
    objs = build(s, router_cluster_role="my-router-role")
    d = objs["Deployment/s-router"]["spec"]
    pod = d["template"]["spec"]
    c = pod["containers"][0]
    assert d["replicas"] == 2
    assert d["selector"]["matchLabels"] == {"slofleet.dev/service": "s", "slofleet.dev/role": "router"}
    assert objs["Service/s-router"]["spec"]["selector"] == d["selector"]["matchLabels"]
    assert objs["Service/s-router"]["spec"]["ports"] == [{"name": "http", "port": 9090, "targetPort": "http"}]
    assert c["command"] == ["slofleet", "router"] and c["image"] == CONTROL_IMAGE  # no torch without precise
    assert [arg(c, f) for f in ("--port", "--k8s-llmservice", "--k8s-port-name", "--prefill-threshold-tokens",
                                "--hold-timeout-seconds", "--policy", "--grace-period", "--host",
                                "--max-model-len")] == \
        ["9090", "ns/s", "http", "1024", "30", "least-load", "20", "$(POD_IP)", "8192"]
    # The buckets from the ConfigMap, which it re-reads when it changes.
    assert arg(c, "--buckets") == "/etc/slofleet/policy.json"
    assert {"name": "config", "configMap": {"name": "s-engine"}} in pod["volumes"]
    assert d["template"]["metadata"]["annotations"] == \
        objs["Deployment/s-decode"]["spec"]["template"]["metadata"]["annotations"]
    # Ready while no engine is (it holds requests for the autoscaler to scale from zero).
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 9090}
    assert pod["serviceAccountName"] == "s-router" and "ServiceAccount/s-router" in objs
    rb = objs["RoleBinding/s-router"]
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "my-router-role"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "s-router", "namespace": "ns"}]
    # Its Service is not one of the engines' that it discovers (those carry an engine role).
    assert objs["Service/s-router"]["metadata"]["labels"]["slofleet.dev/role"] == "router"
    assert not [k for k in build(svc({"router": {"enabled": False}})) if "router" in k]


@pytest.mark.parametrize("pool,auto,decision,expected", [
    (Pool(min_replicas=1, max_replicas=5), False, None, 1),
    (Pool(min_replicas=1, max_replicas=5, replicas=4), False, None, 4),
    (Pool(min_replicas=1, max_replicas=5, replicas=4), False, RoleAutoscaling(desired_replicas=2), 4),  # off: ignored
    (Pool(min_replicas=1, max_replicas=5, replicas=4), True, RoleAutoscaling(desired_replicas=2), 2),
    (Pool(min_replicas=1, max_replicas=5), True, RoleAutoscaling(desired_replicas=9), 5),  # clamped to max
    (Pool(min_replicas=2, max_replicas=5), True, RoleAutoscaling(desired_replicas=0), 2),  # clamped to min
    (Pool(min_replicas=2, max_replicas=5, replicas=3), True, RoleAutoscaling(), 3),  # no decision yet
])
def test_replicas_follow_one_writer_and_the_bounds(pool, auto, decision, expected):
    assert children.replicas(pool, auto, decision) == expected


def test_autoscaler_decision_from_status_is_clamped_into_the_deployment():
    s = svc({"autoscaling": {"enabled": True}, "topology": {"unified": {"minReplicas": 1, "maxReplicas": 3}}},
            {"autoscaling": {"unified": {"desiredReplicas": 7, "reason": "queue"}}})
    assert build(s)["Deployment/s-unified"]["spec"]["replicas"] == 3


def test_engine_fields_become_serve_flags():
    e = {"port": 9000, "dtype": "float32", "blockSize": 32, "kvCacheMemoryGb": 0.5, "maxNumSeqs": 8,
         "maxNumBatchedTokens": 512, "maxModelLen": 4096, "enablePrefixCaching": False, "maxWaitingRequests": 7,
         "maxQueuedTokens": 999, "drainSeconds": 20}
    c = engine(build(svc({"engine": e})))
    assert [arg(c, f) for f in ("--port", "--dtype", "--block-size", "--kv-cache-memory-gb", "--max-num-seqs",
                                "--max-num-batched-tokens", "--max-model-len", "--max-waiting-requests",
                                "--max-queued-tokens", "--grace-period")] == \
        ["9000", "float32", "32", "0.5", "8", "512", "4096", "7", "999", "20"]
    assert "--no-enable-prefix-caching" in c["args"] and "--enable-prefix-caching" not in c["args"]
    assert c["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 9000}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": 9000}


def test_image_env_probes_and_drain():
    c_spec = {"image": "reg/x:1", "imagePullPolicy": "Always", "env": {"B": "2", "A": "1"},
              "startupSeconds": 600, "drainSeconds": 90}
    objs = build(svc({"engine": c_spec}))
    pod = objs["Deployment/s-unified"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert (c["image"], c["imagePullPolicy"]) == ("reg/x:1", "Always")
    assert [e for e in c["env"] if "value" in e and e["name"] in "AB"] == [{"name": "A", "value": "1"},
                                                                          {"name": "B", "value": "2"}]
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 600
    assert pod["terminationGracePeriodSeconds"] == 100  # the engine's 90 s drain + slack
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_resources_and_gpus():
    c_spec = {"resources": {"requests": {"cpu": 2, "memory": "8Gi"}, "limits": {"memory": "8Gi"}}, "gpus": 1}
    pod = build(svc({"engine": c_spec}))["Deployment/s-unified"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"},
                                                 "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"}}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    cpu_pod = build(svc())["Deployment/s-unified"]["spec"]["template"]["spec"]
    assert "tolerations" not in cpu_pod and "nvidia.com/gpu" not in cpu_pod["containers"][0]["resources"]["limits"]


def test_model_sources():
    emb = build(svc({"model": {"name": "default"}}))["Deployment/s-unified"]["spec"]["template"]["spec"]
    assert [v["name"] for v in emb["volumes"]] == ["tmp", "cache"] and "initContainers" not in emb
    pvc = build(svc({"model": {"name": "llama.gguf", "source": "pvc", "pvcName": "weights", "path": "/w"}}))
    pod = pvc["Deployment/s-unified"]["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert arg(pod["containers"][0], "--model") == "/w/llama.gguf"
    init = build(svc({"model": {"name": "m", "source": "init", "initImage": "fetch:1", "initCommand": ["get", "m"]}}))
    pod = init["Deployment/s-unified"]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["image"] == "fetch:1" and pod["initContainers"][0]["command"] == ["get", "m"]
    assert {"name": "model", "emptyDir": {}} in pod["volumes"]
    assert arg(pod["containers"][0], "--model") == "/models/m"


def test_buckets_reach_the_router_and_without_it_the_engines():
    s = svc({"buckets": BUCKETS})
    objs = build(s)
    policy = json.loads(objs["ConfigMap/s-engine"]["data"]["policy.json"])
    assert [b["name"] for b in policy["buckets"]] == ["chat", "doc"]
    assert policy["buckets"][1]["match"] == {"minPromptTokens": 2000}
    assert policy["buckets"][1]["slo"] == {"percentile": 90.0, "e2eMs": 9000}
    # Behind the router (which gives each request its bucket's priority) the engines do not read the buckets.
    assert "--bucket-priorities" not in engine(objs)["args"]
    assert arg(engine(build(svc({"buckets": BUCKETS, "router": {"enabled": False}}))), "--bucket-priorities") == \
        "chat=0,doc=5"
    assert bucket_priorities([Bucket.model_validate(b) for b in BUCKETS]) == "chat=0,doc=5"
    # and the TPOT targets that bound their steps' prompt work, through the engine's own parser
    direct = engine(build(svc({"buckets": [{"name": "chat", "slo": {"tpotMs": 40}}, *BUCKETS[1:]],
                               "router": {"enabled": False}})))
    assert EngineConfig(bucket_tpot_ms=arg(direct, "--bucket-tpot-ms")).bucket_tpot_map() == {"chat": 0.04}
    assert "--bucket-tpot-ms" not in engine(build(svc({"buckets": BUCKETS, "router": {"enabled": False}})))["args"]


def test_buckets_from_a_policy_when_the_spec_has_none():
    policy = [Bucket.model_validate(b) for b in BUCKETS[:1]]
    objs = build(svc({"policyRef": "std", "router": {"enabled": False}}), buckets=policy)
    assert arg(engine(objs), "--bucket-priorities") == "chat=0"


def templates(objs: dict) -> dict:
    return {k: o["spec"]["template"] for k, o in objs.items() if o["kind"] == "Deployment"}


def test_a_bucket_change_rolls_no_pod_and_a_new_token_rolls_them_all():
    changed = [{**BUCKETS[0], "priority": 3, "slo": {"percentile": 90, "ttftMs": 100, "e2eMs": 2000},
                "admission": {"maxWaitingRequests": 4}}, BUCKETS[1]]
    before, after = build(svc({"buckets": BUCKETS})), build(svc({"buckets": changed}))
    assert templates(before) == templates(after)  # the router re-reads the ConfigMap; the engines never read it
    assert before["ConfigMap/s-engine"] != after["ConfigMap/s-engine"]
    rolled = templates(build(svc({"buckets": BUCKETS}), internal_token="n3w"))
    assert all(t["metadata"]["annotations"] != rolled[k]["metadata"]["annotations"]
               for k, t in templates(before).items())


def test_service_monitor_only_when_its_crd_exists():
    assert "ServiceMonitor/s" not in build(svc())
    sm = build(svc(), service_monitor=True)["ServiceMonitor/s"]
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]


def test_children_are_deterministic():
    # Idempotence starts here: the same spec gives byte-identical children.
    s = svc({"buckets": BUCKETS, "topology": {"mode": "disaggregated", "prefill": {}, "decode": {}}})
    assert json.dumps(children.desired(s, children.Inputs(s.spec.buckets, "t"))) == \
        json.dumps(children.desired(s, children.Inputs(s.spec.buckets, "t")))


def _dep(desired: int, ready: int, updated: int | None = None, gen: int = 2, seen: int = 2, conds=()):
    return {"metadata": {"generation": gen},
            "status": {"replicas": desired, "readyReplicas": ready,
                       "updatedReplicas": desired if updated is None else updated,
                       "observedGeneration": seen, "conditions": list(conds)}}


def test_status_ready_progressing_degraded():
    roles = {"unified": status.observe(_dep(2, 2), 2)}
    st = status.status_patch(roles, 3, "http://e", [], "T1")
    conds = {c["type"]: c for c in st["conditions"]}
    assert (conds["Ready"]["status"], conds["Progressing"]["status"], conds["Degraded"]["status"]) == \
        ("True", "False", "False")
    assert st["observedGeneration"] == 3 and st["endpoint"] == "http://e"
    assert st["roles"] == {"unified": {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2}}
    assert all(c["observedGeneration"] == 3 for c in st["conditions"])

    rolling = {"unified": status.observe(_dep(2, 1, updated=1, seen=1), 2)}
    conds2 = {c["type"]: c for c in status.conditions(rolling, 3, st["conditions"], "T2")}
    assert conds2["Ready"]["status"] == "False" and conds2["Ready"]["message"] == "ready: unified 1/2"
    assert conds2["Ready"]["lastTransitionTime"] == "T2"
    assert conds2["Progressing"]["reason"] == "RollingOut"
    assert conds2["Degraded"]["lastTransitionTime"] == "T1"  # unchanged status keeps its time

    failing = {"decode": status.observe(_dep(1, 0, conds=[{"type": "ReplicaFailure", "status": "True",
                                                           "message": "quota exceeded"}]), 1)}
    conds3 = {c["type"]: c for c in status.conditions(failing, 3, [], "T3")}
    assert conds3["Degraded"]["status"] == "True" and conds3["Degraded"]["message"] == "decode: quota exceeded"


def test_status_of_a_missing_deployment():
    o = status.observe(None, 1)
    assert (o.replicas, o.ready, o.current_generation) == (0, 0, False)
