"""Writes kubeconform's strict JSON schemas offline: the built-in kinds from a Kubernetes OpenAPI v3 folder
(api/openapi-spec/v3 of the k8s.io/kubernetes Go module) and custom kinds from CRD files.

Files are named as kubeconform's `{{ .ResourceKind }}{{ .KindSuffix }}.json` template expects (deployment-apps-v1,
service-v1, llmservice-slofleet-v1alpha1). Strict means what kubeconform's published `-strict` schemas mean: an
object with declared properties admits no others, so a misspelt field fails instead of being dropped.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

REF = "#/components/schemas/"


def file_name(group: str, version: str, kind: str) -> str:
    suffix = f"-{group.split('.')[0].lower()}-{version}" if group else f"-{version}"
    return f"{kind.lower()}{suffix}.json"


def strict(node: dict) -> dict:
    """A copy with additionalProperties false wherever properties are declared and unknown fields not kept.

    Walks schema keywords only: a property may itself be named `$ref` or `properties` (JSONSchemaProps)."""
    out = dict(node)
    if isinstance(out.get("$ref"), str):
        out["$ref"] = "#/definitions/" + out["$ref"].removeprefix(REF)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(v) for v in out[key]]
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def refs(node: object) -> set[str]:
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    if not isinstance(node, dict):
        return set()
    found = {node["$ref"].removeprefix(REF)} if isinstance(node.get("$ref"), str) else set()
    return found.union(*(refs(v) for v in node.values()))


def closure(name: str, schemas: dict[str, dict]) -> dict[str, dict]:
    """Every schema that `name` reaches through $ref (recursive types included once)."""
    seen: dict[str, dict] = {}
    todo = [name]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen[n] = schemas[n]
            todo += refs(schemas[n]) - seen.keys()
    return seen


def builtin(openapi: Path, out: Path) -> int:
    schemas: dict[str, dict] = {}
    for f in sorted(openapi.glob("*.json")):
        schemas.update(json.loads(f.read_text()).get("components", {}).get("schemas", {}))
    count = 0
    for name, schema in schemas.items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            reached = closure(name, schemas)
            doc = {**strict(schema), "definitions": {n: strict(s) for n, s in reached.items()}}
            (out / file_name(gvk["group"], gvk["version"], gvk["kind"])).write_text(json.dumps(doc))
            count += 1
    return count


def custom(crd_files: list[Path], out: Path) -> int:
    count = 0
    for f in crd_files:
        for crd in yaml.safe_load_all(f.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                schema = dict(version["schema"]["openAPIV3Schema"])
                props = {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                         "metadata": {"type": "object"}, **schema.get("properties", {})}
                doc = strict({**schema, "properties": props})
                name = file_name(spec["group"], version["name"], spec["names"]["kind"])
                (out / name).write_text(json.dumps(doc))
                count += 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--openapi", type=Path, help="a Kubernetes api/openapi-spec/v3 folder")
    parser.add_argument("--crd", type=Path, action="append", default=[], help="a CRD file (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the schemas into")
    args = parser.parse_args()
    if args.openapi and not args.openapi.is_dir():
        print(f"kube_schemas: no OpenAPI folder {args.openapi}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    n = builtin(args.openapi, args.out) if args.openapi else 0
    n += custom(args.crd, args.out)
    print(f"kube_schemas: {n} schemas in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
