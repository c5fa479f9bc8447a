"""Every slofleet workload passes the "restricted" Pod Security Standard: a Pod from each pod template (the engine's
of every role and model source, the router's, the operator's and autoscaler's from manifests/ and from the
rendered chart) is admitted, dry run, into a namespace that enforces it; a pod that misses one setting is not."""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from slofleet.api.v1alpha1 import LLMService
from slofleet.operator import children
from tests.k8s.conftest import REPO, wait_until

TOPOLOGIES = {"unified": {}, "disaggregated": {"mode": "disaggregated", "prefill": {}, "decode": {}}}
SOURCES = {"embedded": {"name": "default"},
           "pvc": {"name": "m.gguf", "source": "pvc", "pvcName": "weights"},
           "init": {"name": "m", "source": "init", "initImage": "fetch:1", "initCommand": ["fetch", "m"]}}


def operator_templates(ns: str) -> dict[str, dict]:
    """Every Deployment the operator makes, for each topology and model source: name -> pod template."""
    out = {}
    for (topo, topology), (source, model) in ((t, s) for t in TOPOLOGIES.items() for s in SOURCES.items()):
        svc = LLMService.model_validate({"metadata": {"name": "s", "namespace": ns, "uid": "u"},
                                         "spec": {"topology": topology, "model": model}})
        for obj in children.desired(svc, children.Inputs(buckets=svc.spec.buckets, internal_token="t")):
            if obj["kind"] == "Deployment":
                out[f"{obj['metadata']['name']}-{source}-{topo}"] = obj["spec"]["template"]
    return out


def deployment_templates(text: str, where: str) -> dict[str, dict]:
    return {f"{where}-{d['metadata']['name']}": d["spec"]["template"]
            for d in yaml.safe_load_all(text) if d and d["kind"] == "Deployment"}


def admit(cluster, ns: str, name: str, template: dict):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**template.get("metadata", {}), "name": name[:63]},
           "spec": template["spec"]}
    return cluster.kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", input=json.dumps(pod), check=False)


@pytest.fixture
def restricted_ns(crds, namespace):
    crds.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted",
                 "pod-security.kubernetes.io/enforce-version=latest")
    # Admission also checks that a pod's ServiceAccount exists.
    wait_until("the default ServiceAccount", lambda: crds.get("serviceaccount", "default", namespace))
    return namespace


def test_every_workload_is_admitted_under_restricted_pod_security(crds, restricted_ns):
    ns = restricted_ns
    templates = operator_templates(ns)
    assert len(templates) == 3 * 5  # per source: a unified engine, a prefill and a decode engine, two routers
    templates |= deployment_templates(crds.kubectl("kustomize", str(REPO / "manifests")).stdout, "manifests")
    templates |= deployment_templates(crds.helm("template", "slofleet", str(REPO / "charts" / "slofleet"),
                                                "--namespace", ns).stdout, "chart")
    assert sum(k.startswith(("manifests-", "chart-")) for k in templates) == 4  # operator and autoscaler, twice
    for sa in {t["spec"].get("serviceAccountName") for t in templates.values()} - {None}:
        crds.kubectl("create", "serviceaccount", sa, "-n", ns, check=False)
    refused = {}
    for name, template in templates.items():
        r = admit(crds, ns, name, template)
        if r.returncode:
            refused[name] = r.stderr.strip()
    assert not refused, json.dumps(refused, indent=1)
    engine = templates["s-unified-init-unified"]["spec"]
    assert engine["automountServiceAccountToken"] is False and "serviceAccountName" not in engine
    assert engine["initContainers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e.get("value") for e in engine["containers"][0]["env"]}
    mounts = {m["mountPath"] for m in engine["containers"][0]["volumeMounts"]}
    assert env["HOME"] == env["TMPDIR"] == "/tmp" and {"/tmp", env["SLOFLEET_CACHE"]} <= mounts
    # The same pod missing a single setting is refused, so the test above can fail.
    for drop in ("seccompProfile", "runAsNonRoot"):
        bad = copy.deepcopy(templates["s-unified-embedded-unified"])
        del bad["spec"]["securityContext"][drop]
        r = admit(crds, ns, f"bad-{drop.lower()}", bad)
        assert r.returncode and "violates PodSecurity" in r.stderr and drop in r.stderr, r.stderr
