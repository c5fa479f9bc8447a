"""Generates the CRD YAML from the pydantic models: `python -m slofleet.api.crd [outdir]`; without an outdir
into `crds/` (for `kubectl apply -f crds/`) and its two copies, `charts/slofleet/crds/` (helm installs CRDs
only from the chart's own folder) and `manifests/crds/` (kustomize reads no files above its root).

Pydantic's JSON schema uses $refs, anyOf-with-null and titles; Kubernetes wants a structural schema:
every node typed, everything inlined, no nulls. `structural()` does that translation and nothing else, so
the models stay the one source of truth and a test fails when the checked-in YAML drifts from them.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from slofleet.api import v1alpha1 as v1

# Schema keywords Kubernetes accepts that we carry over unchanged.
_KEEP = {"type", "description", "enum", "pattern", "minimum", "maximum", "minLength", "maxLength", "minItems",
         "maxItems", "default", "format", "x-kubernetes-validations"}


def structural(node: dict, defs: dict) -> dict:
    if "$ref" in node:
        return structural(defs[node["$ref"].split("/")[-1]] | {k: v for k, v in node.items() if k != "$ref"}, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if {b.get("type") for b in branches} == {"integer", "string"}:
            return {"x-kubernetes-int-or-string": True} | _keep(rest)
        if len(branches) != 1:
            raise ValueError(f"cannot make a structural schema of {node}")
        return structural(branches[0] | rest, defs)
    out = _keep(node)
    if "description" in out:  # docstrings wrap; the schema wants one line
        out["description"] = " ".join(out["description"].split())
    if "exclusiveMinimum" in node:  # OpenAPI v3.0 spells it as a boolean beside minimum
        out |= {"minimum": node["exclusiveMinimum"], "exclusiveMinimum": True}
    if "exclusiveMaximum" in node:
        out |= {"maximum": node["exclusiveMaximum"], "exclusiveMaximum": True}
    if "const" in node:
        out["enum"] = [node["const"]]
    if out.get("default") is None:
        out.pop("default", None)
    if "properties" in node:
        out["type"] = "object"
        out["properties"] = {k: structural(v, defs) for k, v in node["properties"].items()}
        if node.get("required"):
            out["required"] = list(node["required"])
        if out.get("default") == {}:
            # The API server checks a default against the node's CEL rules as it stands, without filling
            # in nested defaults: spell them out.
            out["default"] = {k: v["default"] for k, v in out["properties"].items() if "default" in v}
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(node["additionalProperties"], defs)
    elif node.get("type") == "object":  # a free-form dict (metadata): let the API server keep it
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "items" in node:
        out["items"] = structural(node["items"], defs)
    return out


def _keep(node: dict) -> dict:
    return {k: v for k, v in node.items() if k in _KEEP}


def openapi_schema(model: type[v1.BaseModel]) -> dict:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema = structural(raw, raw.get("$defs", {}))
    props = schema["properties"]
    for owned_by_the_api_server in ("apiVersion", "kind", "metadata"):
        props.pop(owned_by_the_api_server)
    required = {"required": ["spec"]} if "spec" in schema.get("required", []) else {}
    return {"type": "object", "properties": props, **required}


def _crd(kind: str, plural: str, short: list[str], model: type, columns: list[dict]) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{v1.GROUP}"},
        "spec": {
            "group": v1.GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower(),
                      "shortNames": short, "categories": ["slofleet"]},
            "versions": [{
                "name": v1.VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema(model)},
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
            }],
        },
    }


def crds() -> dict[str, dict]:
    """file name -> CRD object."""
    age = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    return {
        "slofleet.dev_llmservices.yaml": _crd("LLMService", "llmservices", ["llms"], v1.LLMService, [
            {"name": "Mode", "type": "string", "jsonPath": ".spec.topology.mode"},
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
            {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
            {"name": "Attainment", "type": "number", "jsonPath": ".status.attainment",
             "description": "the worst bucket's SLO attainment"},
            {"name": "SLOMet", "type": "string", "jsonPath": '.status.conditions[?(@.type=="SLOMet")].status',
             "priority": 1},
            {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
            age,
        ]),
        "slofleet.dev_slopolicies.yaml": _crd("SLOPolicy", "slopolicies", ["slop"], v1.SLOPolicy, [
            {"name": "Buckets", "type": "string", "jsonPath": ".spec.buckets[*].name"},
            age,
        ]),
    }


def render(crd: dict) -> str:
    return "# Generated by `python -m slofleet.api.crd` from crds/slofleet/api; do not edit.\n" + \
        yaml.safe_dump(crd, sort_keys=False, width=120)


def targets() -> list[Path]:
    repo = Path(__file__).resolve().parents[3]
    return [repo / "crds", repo / "charts" / "slofleet" / "crds", repo / "manifests" / "crds"]


def main(argv: list[str]) -> int:
    for out in [Path(argv[0])] if argv else targets():
        out.mkdir(parents=True, exist_ok=True)
        for name, crd in crds().items():
            (out / name).write_text(render(crd))
            print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
