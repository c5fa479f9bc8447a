"""The CRDs against a real API server: applied with kubectl, defaults filled in, every CEL rule and a
schema rule of each kind rejecting one invalid manifest with the exact message a user sees."""
from __future__ import annotations

import json

import pytest
import yaml

from slofleet.api.contract import ENGINE_SETTINGS, Setting
from slofleet.api.v1alpha1 import to_camel
from slofleet.engine.config import EngineConfig
from tests.k8s.conftest import REPO

POOL = {"minReplicas": 1, "maxReplicas": 2}
SLO = {"ttftMs": 100}

# (what is wrong, spec, the field kubectl names, the rule's message)
INVALID = [
    ("min above max", {"topology": {"unified": {"minReplicas": 3, "maxReplicas": 2}}},
     "spec.topology.unified",
     "minReplicas must be <= maxReplicas"),
    ("replicas out of bounds", {"topology": {"unified": {"minReplicas": 1, "maxReplicas": 2, "replicas": 5}}},
     "spec.topology.unified",
     "replicas must lie within [minReplicas, maxReplicas]"),
    ("disaggregated without decode", {"topology": {"mode": "disaggregated", "prefill": POOL}},
     "spec.topology",
     "topology.mode disaggregated needs both topology.prefill and topology.decode"),
    ("unified with a prefill pool", {"topology": {"mode": "unified", "prefill": POOL}},
     "spec.topology",
     "topology.mode unified takes no prefill/decode pools: use topology.unified or set mode: disaggregated"),
    ("percentile 100", {"buckets": [{"name": "a", "slo": {"percentile": 100, "ttftMs": 1}}]},
     "spec.buckets[0].slo",
     "slo.percentile must be > 0 and < 100, e.g. 99 for p99"),
    ("slo without targets", {"buckets": [{"name": "a", "slo": {"percentile": 99}}]},
     "spec.buckets[0].slo",
     "slo needs at least one target: ttftMs, tpotMs or e2eMs"),
    ("duplicate bucket names", {"buckets": [{"name": "a", "slo": SLO}, {"name": "a", "slo": SLO}]},
     "spec.buckets",
     "bucket names must be unique"),
    ("prompt range reversed", {"buckets": [{"name": "a", "slo": SLO,
                                            "match": {"minPromptTokens": 10, "maxPromptTokens": 5}}]},
     "spec.buckets[0].match",
     "match.minPromptTokens must be <= match.maxPromptTokens"),
    ("pvc source without a claim", {"model": {"source": "pvc"}}, "spec.model", "model.source pvc needs model.pvcName"),
    ("init source without an image", {"model": {"source": "init"}},
     "spec.model",
     "model.source init needs model.initImage and model.initCommand"),
    ("block size not a power of two", {"engine": {"blockSize": 24}}, "spec.engine", "blockSize must be a power of two"),
]
# Schema (non-CEL) rules: one of each kind the CRD uses.
INVALID_SCHEMA = [
    ("unknown mode", {"topology": {"mode": "mixed"}},
     'spec.topology.mode: Unsupported value: "mixed": supported values: "unified", "disaggregated"'),
    ("port 0", {"engine": {"port": 0}}, "spec.engine.port: Invalid value: 0: spec.engine.port in body should be "
                                       "greater than or equal to 1"),
    ("bad bucket name", {"buckets": [{"name": "Chat!", "slo": SLO}]}, "spec.buckets[0].name: Invalid value: "
                                                                        '"Chat!": spec.buckets[0].name in body should '
                                                                        "match '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'"),
    ("bucket without slo", {"buckets": [{"name": "a"}]}, 'spec.buckets[0].slo: Required value'),
    ("replicas not a number", {"topology": {"unified": {"minReplicas": "one"}}},
     'spec.topology.unified.minReplicas: Invalid value: "string": spec.topology.unified.minReplicas in body must be '
     'of type integer: "string"'),
]


def refused_values(setting: Setting) -> list:
    """Values the engine refuses at start, one per rule of the setting."""
    out: list = []
    if setting.choices:
        out.append("float16x")
    if setting.positive:
        out += [0, -1.5]
    if setting.minimum is not None:
        out.append(int(setting.minimum) - 1)
    if setting.maximum is not None:
        out.append(int(setting.maximum) * 2)
    if setting.power_of_two:
        out.append(24)
    return out


ENGINE_REFUSED = [(name, value) for name, s in ENGINE_SETTINGS.items() for value in refused_values(s)]


def test_every_engine_rule_has_a_refused_value():
    ruled = {name for name, s in ENGINE_SETTINGS.items()
             if s.choices or s.positive or s.minimum is not None or s.maximum is not None or s.power_of_two}
    assert ruled == {name for name, _ in ENGINE_REFUSED}


@pytest.mark.parametrize("name,value", ENGINE_REFUSED, ids=[f"{n}={v}" for n, v in ENGINE_REFUSED])
def test_crd_refuses_what_the_engine_refuses(crds, namespace, name, value):
    with pytest.raises(ValueError):
        EngineConfig(**{name: value})
    r = crds.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                     input=manifest("bad", {"engine": {to_camel(name): value}}))
    assert r.returncode != 0 and "spec.engine" in r.stderr, f"{name}={value} accepted: {r.stdout}"


def manifest(name: str, spec: dict) -> str:
    return json.dumps({"apiVersion": "slofleet.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": name},
                       "spec": spec})


@pytest.mark.parametrize("what,spec,field,message", INVALID, ids=[i[0] for i in INVALID])
def test_cel_rule_rejects_with_its_message(crds, namespace, what, spec, field, message):
    r = crds.kubectl("apply", "-n", namespace, "-f", "-", input=manifest("bad", spec), check=False)
    assert r.returncode != 0, f"{what}: accepted"
    assert r.stderr.strip() == f'The LLMService "bad" is invalid: {field}: Invalid value: {message}'


@pytest.mark.parametrize("what,spec,message", INVALID_SCHEMA, ids=[i[0] for i in INVALID_SCHEMA])
def test_schema_rule_rejects_with_its_message(crds, namespace, what, spec, message):
    r = crds.kubectl("apply", "-n", namespace, "-f", "-", input=manifest("bad", spec), check=False)
    assert r.returncode != 0, f"{what}: accepted"
    # The first error is ours; the API server may add that it skipped the CEL rules of an invalid object.
    errors = [e.strip() for e in r.stderr.split("is invalid: ", 1)[1].split("\n* ") if e.strip()]
    assert errors[0] == message, r.stderr


def test_examples_are_accepted_and_defaulted(crds, namespace):
    crds.kubectl("apply", "-n", namespace, "-f", str(REPO / "manifests" / "examples"))
    got = crds.get("llmservice", "chat", namespace)
    assert got["spec"]["engine"]["port"] == 8000  # defaulted by the API server from the schema
    assert got["spec"]["engine"]["maxNumSeqs"] == 32  # given
    assert got["spec"]["autoscaling"] == {"enabled": False, "intervalSeconds": 15, "scaleDownStabilizationSeconds": 300,
                                          "scaleUpStabilizationSeconds": 0, "signals": ["slo", "queue"],
                                          "targetKvCacheUsage": 0.8}
    assert got["spec"]["buckets"][1]["slo"] == {"percentile": 90, "ttftMs": 4000, "e2eMs": 30000}
    docs = crds.get("llmservice", "docs", namespace)
    assert docs["spec"]["model"] == {"name": "default", "source": "embedded", "path": "/models"}
    assert "unified" not in docs["spec"]["topology"]  # optional pools get no default


def test_printer_columns_and_status_subresource(crds, namespace):
    crds.kubectl("apply", "-n", namespace, "-f", str(REPO / "manifests" / "examples" / "llmservice-unified.yaml"))
    out = crds.kubectl("get", "llms", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert out[0].split() == ["NAME", "MODE", "MODEL", "READY", "ENDPOINT", "AGE"]
    assert out[1].split()[:3] == ["chat", "unified", "default"]
    # Status is a subresource: a spec write does not change it, a status write does.
    patch = json.dumps({"status": {"endpoint": "http://x"}})
    crds.kubectl("patch", "llms", "chat", "-n", namespace, "--type=merge", "-p", patch)
    assert "endpoint" not in (crds.get("llms", "chat", namespace).get("status") or {})
    crds.kubectl("patch", "llms", "chat", "-n", namespace, "--subresource=status", "--type=merge", "-p", patch)
    assert crds.get("llms", "chat", namespace)["status"]["endpoint"] == "http://x"


def test_slopolicy(crds, namespace):
    crds.kubectl("apply", "-n", namespace, "-f", str(REPO / "manifests" / "examples" / "slopolicy.yaml"))
    r = crds.kubectl("apply", "-n", namespace, "-f", "-", check=False, input=yaml.safe_dump(
        {"apiVersion": "slofleet.dev/v1alpha1", "kind": "SLOPolicy", "metadata": {"name": "dup"},
         "spec": {"buckets": [{"name": "a", "slo": SLO}, {"name": "a", "slo": SLO}]}}))
    assert r.returncode and "bucket names must be unique" in r.stderr
