"""slofleet.api: the models' defaults and the generated CRDs (no cluster needed)."""
from __future__ import annotations

import subprocess
import sys

import yaml

from slofleet.api import crd
from slofleet.api.v1alpha1 import LLMService, SLOPolicy
from tests.support import ROOT
from tests.support.invalid_specs import INVALID


def test_checked_in_crds_match_the_models():
    # Fails when a model changed without `make crds` (or `python -m slofleet.api.crd`).
    for folder in crd.targets():
        for name, obj in crd.crds().items():
            assert (folder / name).read_text() == crd.render(obj), f"{folder / name} drifted: run make crds"


def _walk(node: dict, path: str = "$"):
    yield path, node
    for k, v in (node.get("properties") or {}).items():
        yield from _walk(v, f"{path}.{k}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}[*]")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_schemas_are_structural():
    for obj in crd.crds().values():
        version = obj["spec"]["versions"][0]
        assert version["subresources"] == {"status": {}}
        assert version["additionalPrinterColumns"]
        for path, node in _walk(version["schema"]["openAPIV3Schema"]):
            assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
            assert "type" in node or node.get("x-kubernetes-int-or-string") or \
                node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
            for rule in node.get("x-kubernetes-validations", []):
                assert rule["message"] and rule["rule"], path


def test_every_cel_rule_has_an_invalid_example_in_the_cluster_tests():
    rules = {r["message"] for obj in crd.crds().values()
             for _, node in _walk(obj["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
             for r in node.get("x-kubernetes-validations", [])}
    assert rules <= {invalid[-1] for invalid in INVALID}


def test_defaults_match_between_python_and_schema():
    svc = LLMService.model_validate({"metadata": {"name": "x"}})
    schema = crd.crds()["slofleet.dev_llmservices.yaml"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    engine = schema["properties"]["spec"]["properties"]["engine"]["properties"]
    assert engine["port"]["default"] == svc.spec.engine.port == 8000
    assert engine["maxNumSeqs"]["default"] == svc.spec.engine.max_num_seqs
    assert svc.spec.topology.mode == "unified" and list(svc.spec.topology.pools()) == ["unified"]
    assert svc.spec.autoscaling.enabled is False


def test_examples_parse():
    for path in sorted((ROOT / "manifests" / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            model = {"LLMService": LLMService, "SLOPolicy": SLOPolicy}[doc["kind"]]
            assert model.model_validate(doc).wire()["spec"], path


def test_api_does_not_import_torch():
    # In a fresh interpreter: another test of the session may have imported torch already.
    code = "import sys, slofleet.api, slofleet.operator.handlers, slofleet.operator.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
