"""tools/kube_schemas.py: kubeconform's offline strict schemas, from an OpenAPI v3 folder and from crds/."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import kube_schemas  # noqa: E402

REF = "#/components/schemas/"


def test_file_names_follow_kubeconforms_template():
    assert kube_schemas.file_name("apps", "v1", "Deployment") == "deployment-apps-v1.json"
    assert kube_schemas.file_name("", "v1", "Service") == "service-v1.json"
    assert kube_schemas.file_name("networking.k8s.io", "v1", "NetworkPolicy") == "networkpolicy-networking-v1.json"


def test_strict_closes_objects_but_not_property_maps_or_open_ones():
    # A schema whose properties are named like keywords (as JSONSchemaProps's are).
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "additionalProperties": {"$ref": REF + "Props"}},
        "$ref": {"type": "string"},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
        "port": {"x-kubernetes-int-or-string": True, "type": "string"}}}
    out = kube_schemas.strict(schema)
    assert out["additionalProperties"] is False
    assert set(out["properties"]) == {"properties", "$ref", "free", "port"}  # nothing added among the names
    assert out["properties"]["properties"]["additionalProperties"] == {"$ref": "#/definitions/Props"}
    assert out["properties"]["$ref"] == {"type": "string"}
    assert "additionalProperties" not in out["properties"]["free"]
    assert out["properties"]["port"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]


def test_builtin_schemas_carry_every_reachable_definition(tmp_path):
    spec = {"components": {"schemas": {
        "Thing": {"x-kubernetes-group-version-kind": [{"group": "example.com", "version": "v1", "kind": "Thing"}],
                  "type": "object", "properties": {"spec": {"allOf": [{"$ref": REF + "Node"}]}}},
        "Node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": REF + "Node"}}}},
        "Unused": {"type": "string"}}}}
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "x_openapi.json").write_text(json.dumps(spec))
    assert kube_schemas.builtin(tmp_path / "api", tmp_path) == 1
    doc = json.loads((tmp_path / "thing-example-v1.json").read_text())
    assert set(doc["definitions"]) == {"Thing", "Node"}  # the recursive one once, the unreachable not at all
    assert doc["properties"]["spec"]["allOf"] == [{"$ref": "#/definitions/Node"}]


def test_crd_schemas_are_strict_and_name_their_kind(tmp_path):
    crds = sorted((REPO / "crds").glob("*.yaml"))
    run = subprocess.run([sys.executable, str(REPO / "tools" / "kube_schemas.py"),
                          *[a for f in crds for a in ("--crd", str(f))], "--out", str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert f"{len(crds)} schemas" in run.stderr
    doc = json.loads((tmp_path / "llmservice-slofleet-v1alpha1.json").read_text())
    assert doc["additionalProperties"] is False and {"apiVersion", "kind", "metadata", "spec"} <= set(doc["properties"])
    assert doc["properties"]["spec"]["additionalProperties"] is False


def test_a_missing_openapi_folder_is_one_line_and_exit_2(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "tools" / "kube_schemas.py"), "--openapi",
                          str(tmp_path / "nope"), "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip().startswith("kube_schemas: no OpenAPI folder")
