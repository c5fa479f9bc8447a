"""spec.engine.runtime: what each runtime refuses (the pydantic side of the CRD's CEL rules, with the same messages),
and the engine pods of vllm and llamacpp rendered from the shared settings (flags, env, probes, images, init steps),
through the operator's own children.desired."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from slofleet.api import crd
from slofleet.api.contract import (
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    LLAMACPP,
    NUM_WAITING,
    RUNTIME_LABEL,
    RUNTIME_METRICS,
    RUNTIMES,
    SLOFLEET,
    VLLM,
    not_exported,
)
from slofleet.api.images import CONTROL_IMAGE
from slofleet.api.runtime import IMAGES, LIMITS, SLOFLEET_IMAGE
from slofleet.api.v1alpha1 import LLMService
from slofleet.operator import children
from slofleet.operator.runtimes import COPY_GGUF, KEY_ENV
from tests.support.invalid_specs import INVALID, runtime_message

PRECISE = {"policy": "precise", "resources": {"limits": {"memory": "2Gi"}}}
BUCKETS = [{"name": "chat", "priority": 0, "slo": {"ttftMs": 300, "tpotMs": 50}}]


def svc(spec: dict) -> LLMService:
    return LLMService.model_validate({"metadata": {"name": "s", "namespace": "ns", "uid": "u", "generation": 1},
                                      "spec": spec})


def pod(spec: dict, role: str = "unified") -> dict:
    s = svc(spec)
    objs = {f"{o['kind']}/{o['metadata']['name']}": o
            for o in children.desired(s, children.Inputs(buckets=s.spec.buckets, internal_token="t0k3n"))}
    return objs[f"Deployment/s-{role}"]["spec"]["template"]


def engine(template: dict) -> dict:
    return template["spec"]["containers"][0]


def flag(c: dict, name: str) -> str:
    return c["args"][c["args"].index(name) + 1]


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


# -- validation --------------------------------------------------------------------------------------------------
REFUSED = [(spec, message) for what, spec, field, message in INVALID if what.endswith(("on vllm", "on llamacpp"))]


def test_every_limit_and_runtime_has_a_refused_case():
    assert {m for _, m in REFUSED} == {lim.message(rt) for lim in LIMITS for rt in lim.refused_by}


@pytest.mark.parametrize("spec,message", REFUSED, ids=[m[:60] for _, m in REFUSED])
def test_pydantic_refuses_what_the_crd_refuses_with_the_same_message(spec, message):
    with pytest.raises(ValidationError) as e:
        svc(spec)
    assert message in str(e.value)
    runtime = spec["engine"]["runtime"]
    assert f"engine.runtime {runtime} " in message  # the message names the runtime


@pytest.mark.parametrize("spec,message", REFUSED, ids=[m[:60] for _, m in REFUSED])
def test_the_same_spec_is_fine_on_slofleet(spec, message):
    ok = svc({**spec, "engine": {**spec["engine"], "runtime": SLOFLEET}})
    assert ok.spec.engine.runtime == SLOFLEET


def test_what_a_runtime_can_do_is_accepted():
    assert svc({"engine": {"runtime": VLLM, "numSpeculativeTokens": 4, "dtype": "bfloat16"}, "router": PRECISE})
    assert svc({"engine": {"runtime": LLAMACPP}, "router": {"policy": "least-load"}})
    assert svc({"engine": {"runtime": LLAMACPP}, "router": {"enabled": False, "policy": "precise"}})


def test_an_unknown_runtime_is_refused():
    with pytest.raises(ValidationError, match="slofleet"):
        svc({"engine": {"runtime": "sglang"}})


def test_crd_has_the_runtime_enum_its_default_and_one_rule_per_limit():
    schema = crd.crds()["slofleet.dev_llmservices.yaml"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    runtime = spec["properties"]["engine"]["properties"]["runtime"]
    assert runtime["enum"] == list(RUNTIMES) and runtime["default"] == SLOFLEET
    assert "default" not in spec["properties"]["engine"]["properties"]["image"]  # chosen per runtime
    rules = {r["message"]: r["rule"] for r in spec["x-kubernetes-validations"]}
    for lim in LIMITS:
        for rt in lim.refused_by:
            assert rules[lim.message(rt)].startswith(f"self.engine.runtime != '{rt}' || ")
    assert runtime_message("router.policy precise", LLAMACPP) in rules


def test_the_metric_table_maps_every_runtime_and_names_what_is_missing():
    assert set(RUNTIME_METRICS) == set(RUNTIMES)
    assert RUNTIME_METRICS[VLLM].phase("waiting") == NUM_WAITING
    assert RUNTIME_METRICS[LLAMACPP].phase("waiting") == "llamacpp:requests_deferred"
    assert RUNTIME_METRICS[LLAMACPP].phase("queue") is None and not_exported(LLAMACPP) == "not exported by llamacpp"
    for rt in RUNTIMES:  # what the autoscaler's queue signal needs, every runtime has
        assert RUNTIME_METRICS[rt].running and RUNTIME_METRICS[rt].waiting


# -- vLLM --------------------------------------------------------------------------------------------------------
def test_vllm_pod_takes_the_shared_settings_as_its_flags():
    c = engine(pod({"engine": {"runtime": VLLM, "maxNumSeqs": 8, "maxNumBatchedTokens": 256, "maxModelLen": 2048,
                               "dtype": "bfloat16", "blockSize": 32, "enablePrefixCaching": False, "port": 8001,
                               "kvCacheMemoryGb": 2.5, "args": ["--seed", "7"]},
                    "model": {"servedName": "chat-model"}}))
    assert c["command"] == ["vllm", "serve"] and c["args"][0] == "/models/hf"
    assert (flag(c, "--max-num-seqs"), flag(c, "--max-num-batched-tokens"), flag(c, "--max-model-len")) == \
        ("8", "256", "2048")
    assert (flag(c, "--dtype"), flag(c, "--block-size"), flag(c, "--port")) == ("bfloat16", "32", "8001")
    assert flag(c, "--served-model-name") == "chat-model" and flag(c, "--host") == "$(POD_IP)"
    assert "--no-enable-prefix-caching" in c["args"] and "--enable-prefix-caching" not in c["args"]
    assert flag(c, "--scheduling-policy") == "priority"
    assert c["args"][-2:] == ["--seed", "7"]  # engine.args last
    assert env(c)["VLLM_CPU_KVCACHE_SPACE"]["value"] == "3"  # whole GiB, rounded up
    assert env(c)["USER"]["value"] and c["securityContext"]["readOnlyRootFilesystem"]
    mine = engine(pod({"engine": {"runtime": VLLM, "env": {"VLLM_CPU_KVCACHE_SPACE": "5", "USER": "me"}}}))
    assert [(x["name"], x["value"]) for x in mine["env"] if x["name"] in ("VLLM_CPU_KVCACHE_SPACE", "USER")] == \
        [("USER", "me"), ("VLLM_CPU_KVCACHE_SPACE", "5")]  # engine.env wins, once each
    assert "--kv-cache-memory-bytes" not in c["args"] and "--kv-events-config" not in c["args"]
    assert not any(a.startswith("--bucket") or a == "--role" for a in c["args"])  # slofleet serve's own


def test_vllm_on_a_gpu_gets_its_kv_budget_as_a_flag_and_the_gpu_image():
    c = engine(t := pod({"engine": {"runtime": VLLM, "gpus": 1, "kvCacheMemoryGb": 2}}))
    assert flag(c, "--kv-cache-memory-bytes") == str(2 << 30) and "VLLM_CPU_KVCACHE_SPACE" not in env(c)
    assert c["image"] == IMAGES[VLLM].gpu and c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert t["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_vllm_speculation_is_its_ngram_prompt_lookup():
    c = engine(pod({"engine": {"runtime": VLLM, "numSpeculativeTokens": 4, "speculativeNgram": 2}}))
    assert json.loads(flag(c, "--speculative-config")) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 2}


def test_vllm_publishes_kv_events_where_the_router_subscribes_under_precise():
    t = pod({"engine": {"runtime": VLLM}, "router": PRECISE})
    c = engine(t)
    config = json.loads(flag(c, "--kv-events-config"))
    assert config["enable_kv_cache_events"] and config["publisher"] == "zmq"
    assert (config["endpoint"], config["replay_endpoint"]) == (f"tcp://*:{KV_EVENTS_PORT}", f"tcp://*:{KV_REPLAY_PORT}")
    assert flag(c, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert env(c)["PYTHONHASHSEED"]["value"] == ""  # the seed slofleet's engines and the router use when unset
    assert {p["containerPort"] for p in c["ports"]} == {8000, KV_EVENTS_PORT, KV_REPLAY_PORT}
    seeded = engine(pod({"engine": {"runtime": VLLM, "env": {"PYTHONHASHSEED": "7"}}, "router": PRECISE}))
    assert [e["value"] for e in seeded["env"] if e["name"] == "PYTHONHASHSEED"] == ["7"]


def test_vllm_probes_health_and_readiness_by_its_model_list():
    c = engine(pod({"engine": {"runtime": VLLM, "startupSeconds": 600}}))
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health" and c["startupProbe"]["failureThreshold"] == 120
    command = c["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"] and "/v1/models" in command[2] and "'s' in ids" in command[2]
    assert "VLLM_API_KEY" in command[2]


def test_vllm_readiness_probe_passes_only_when_the_served_name_is_listed(tmp_path):
    # The probe's own code against a stand-in /v1/models on loopback, with and without the served name.
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from threading import Thread

    seen: list[str] = []

    class Models(BaseHTTPRequestHandler):
        listed = "s"

        def do_GET(self):
            seen.append(self.headers.get("Authorization", ""))
            body = json.dumps({"data": [{"id": Models.listed}]}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Models)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        c = engine(pod({"engine": {"runtime": VLLM, "port": server.server_port}}))
        code = c["readinessProbe"]["exec"]["command"][2]
        run = {"POD_IP": "127.0.0.1", "VLLM_API_KEY": "t0k3n", "PATH": "/usr/bin:/bin"}
        assert subprocess.run([sys.executable, "-c", code], env=run).returncode == 0
        Models.listed = "other"
        assert subprocess.run([sys.executable, "-c", code], env=run, capture_output=True).returncode == 1
        assert seen[0] == "Bearer t0k3n"
    finally:
        server.shutdown()


def test_vllm_embedded_weights_come_from_slofleets_export_in_an_init_step():
    t = pod({"engine": {"runtime": VLLM, "imagePullPolicy": "Never"}})
    init = t["spec"]["initContainers"][0]
    assert init["command"] == ["slofleet", "export-hf", "/models/hf"] and init["image"] == SLOFLEET_IMAGE
    assert init["imagePullPolicy"] == "Never" and init["securityContext"]["readOnlyRootFilesystem"]
    volumes = {v["name"]: v for v in t["spec"]["volumes"]}
    assert volumes["model"] == {"name": "model", "emptyDir": {}}
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in engine(t)["volumeMounts"]
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
    assert t["metadata"]["labels"][RUNTIME_LABEL] == VLLM


@pytest.mark.parametrize("runtime", [VLLM, LLAMACPP])
def test_pvc_and_init_sources_work_for_every_runtime(runtime):
    t = pod({"engine": {"runtime": runtime}, "model": {"source": "pvc", "pvcName": "w", "name": "m1"}})
    c = engine(t)
    assert "initContainers" not in t["spec"]
    assert (c["args"][0] if runtime == VLLM else flag(c, "-m")) == "/models/m1"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "w", "readOnly": True}} in t["spec"]["volumes"]
    t = pod({"engine": {"runtime": runtime},
             "model": {"source": "init", "initImage": "fetch:1", "initCommand": ["get"], "path": "/w", "name": "m2"}})
    assert [i["image"] for i in t["spec"]["initContainers"]] == ["fetch:1"]
    assert (engine(t)["args"][0] if runtime == VLLM else flag(engine(t), "-m")) == "/w/m2"


# -- llama.cpp ---------------------------------------------------------------------------------------------------
def test_llamacpp_pod_takes_the_shared_settings_as_its_flags():
    c = engine(pod({"engine": {"runtime": LLAMACPP, "maxNumSeqs": 4, "maxNumBatchedTokens": 256,
                               "maxModelLen": 4096, "enablePrefixCaching": False, "args": ["-t", "2"]}}))
    assert c["command"] == ["/app/llama-server"] and flag(c, "-m") == "/models/model.gguf"
    assert (flag(c, "-np"), flag(c, "-c"), flag(c, "-b"), flag(c, "-ub")) == ("4", "4096", "256", "256")
    assert flag(c, "--alias") == "s" and flag(c, "--host") == "$(POD_IP)" and flag(c, "--port") == "8000"
    assert "--metrics" in c["args"] and "--no-cache-prompt" in c["args"] and "--kv-unified" in c["args"]
    assert "--no-repack" in c["args"] and c["args"][-2:] == ["-t", "2"]
    assert c["image"] == IMAGES[LLAMACPP].cpu
    on = engine(pod({"engine": {"runtime": LLAMACPP, "gpus": 1}}))
    assert "--cache-prompt" in on["args"] and "--no-repack" not in on["args"] and on["image"] == IMAGES[LLAMACPP].gpu


def test_llamacpp_probes_its_health_which_is_its_readiness():
    c = engine(pod({"engine": {"runtime": LLAMACPP}}))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": 8000}


def test_llamacpp_embedded_weights_are_the_packaged_gguf_copied_by_an_init_step(tmp_path):
    t = pod({"engine": {"runtime": LLAMACPP}})
    init = t["spec"]["initContainers"][0]
    assert init["image"] == SLOFLEET_IMAGE and init["command"][:2] == ["python", "-c"]
    assert init["command"][-1] == "/models/model.gguf"
    # The copy step itself, here: the package is installed with the engine's dependencies.
    dest = tmp_path / "model.gguf"
    subprocess.run([sys.executable, "-c", COPY_GGUF, str(dest)], check=True)
    assert dest.read_bytes()[:4] == b"GGUF"


# -- both --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("runtime", [VLLM, LLAMACPP])
def test_the_internal_token_is_the_runtimes_api_key_and_env_passes_through(runtime):
    c = engine(pod({"engine": {"runtime": runtime, "env": {"A": "1", KEY_ENV[runtime]: "mine"}}}))
    e = env(c)
    assert e[KEY_ENV[runtime]]["valueFrom"]["secretKeyRef"] == {"name": "s-internal-token", "key": "token"}
    assert [x["name"] for x in c["env"]].count(KEY_ENV[runtime]) == 1  # the user's entry cannot replace it
    assert e["A"]["value"] == "1" and "SLOFLEET_INTERNAL_TOKEN" not in e
    assert not any("t0k3n" in a for a in c["args"])  # the token never shows in the pod spec
    gateway = engine(pod({"engine": {"runtime": runtime}, "router": {"enabled": False},
                          "network": {"gatewayNamespace": "gw"}}))
    assert KEY_ENV[runtime] not in env(gateway)  # a gateway in the router's place sends no token


@pytest.mark.parametrize("runtime", [VLLM, LLAMACPP])
def test_router_and_init_steps_run_slofleets_image_whatever_the_engines_run(runtime):
    s = svc({"engine": {"runtime": runtime, "image": "mine/server:1"}})
    objs = {f"{o['kind']}/{o['metadata']['name']}": o
            for o in children.desired(s, children.Inputs(buckets=[], internal_token="t"))}
    tpl = objs["Deployment/s-unified"]["spec"]["template"]
    assert engine(tpl)["image"] == "mine/server:1"
    assert tpl["spec"]["initContainers"][0]["image"] == SLOFLEET_IMAGE
    # the router runs slofleet's control image, or slofleet's engine image under precise: never the runtime's
    assert objs["Deployment/s-router"]["spec"]["template"]["spec"]["containers"][0]["image"] == CONTROL_IMAGE
    if runtime == VLLM:
        s = svc({"engine": {"runtime": runtime, "image": "mine/server:1"}, "router": {"policy": "precise"}})
        objs = {f"{o['kind']}/{o['metadata']['name']}": o
                for o in children.desired(s, children.Inputs(buckets=[], internal_token="t"))}
        assert objs["Deployment/s-router"]["spec"]["template"]["spec"]["containers"][0]["image"] == SLOFLEET_IMAGE


def test_slofleet_runtime_keeps_its_own_pod():
    t = pod({"engine": {"image": "reg/x:1"}, "buckets": BUCKETS, "router": {"enabled": False}})
    c = engine(t)
    assert c["command"] == ["slofleet", "serve"] and c["image"] == "reg/x:1"
    assert flag(c, "--bucket-priorities") == "chat=0" and c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert env(c)["SLOFLEET_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "s-internal-token"
    assert t["metadata"]["labels"][RUNTIME_LABEL] == SLOFLEET and "initContainers" not in t["spec"]
    assert engine(pod({}))["image"] == SLOFLEET_IMAGE

