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
from tests.support.invalid_specs import INVALID, INVALID_SCHEMA, SLO


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
                                          "scaleUpStabilizationSeconds": 0, "signals": ["slo", "queue", "kvCache"],
                                          "targetKvCacheUsage": 0.8}
    assert got["spec"]["buckets"][1]["slo"] == {"percentile": 90, "ttftMs": 4000, "e2eMs": 30000}
    docs = crds.get("llmservice", "docs", namespace)
    assert docs["spec"]["model"] == {"name": "default", "source": "embedded", "path": "/models"}
    assert "unified" not in docs["spec"]["topology"]  # optional pools get no default


def test_printer_columns_and_status_subresource(crds, namespace):
    crds.kubectl("apply", "-n", namespace, "-f", str(REPO / "manifests" / "examples" / "llmservice-unified.yaml"))
    out = crds.kubectl("get", "llms", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert out[0].split() == ["NAME", "MODE", "MODEL", "READY", "ATTAINMENT", "SLOMET", "ENDPOINT", "AGE"]
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
