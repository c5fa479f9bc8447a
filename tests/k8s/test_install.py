"""The install, both ways: `kubectl apply -k manifests/` and the Helm chart (lint, template, install, uninstall)."""
from __future__ import annotations

import time

import yaml

from slofleet.api.images import CONTROL_IMAGE
from tests.k8s.conftest import REPO, apply_crds, log, wait_until

CHART = str(REPO / "charts" / "slofleet")
NS = "slofleet-system"


def test_helm_lint_and_template_are_clean(cluster):
    lint = cluster.helm("lint", "--strict", CHART)
    assert "0 chart(s) failed" in lint.stdout and "[WARNING]" not in lint.stdout, lint.stdout
    out = cluster.helm("template", "slofleet", CHART, "--namespace", NS, "--include-crds").stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out) if d)
    # ClusterRoles: the operator's, the routers', the autoscaler's; the ConfigMap: the Grafana dashboard
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding",
                     "ConfigMap", "CustomResourceDefinition", "CustomResourceDefinition", "Deployment", "Deployment",
                     "NetworkPolicy", "NetworkPolicy", "Service", "ServiceAccount", "ServiceAccount"]
    deployments = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
                   for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"}
    assert "--router-cluster-role=slofleet-router" in deployments["slofleet-operator"]["args"]
    assert f"--autoscaler-namespace={NS}" in deployments["slofleet-operator"]["args"]  # where the chart puts it
    assert deployments["slofleet-autoscaler"]["command"] == ["slofleet", "autoscaler"]
    assert deployments["slofleet-autoscaler"]["args"] == ["--kubernetes", "--cold-start=90"]
    off = cluster.helm("template", "slofleet", CHART, "--set", "autoscaler.enabled=false").stdout
    assert "slofleet-autoscaler" not in off
    too_many = cluster.helm("template", "x", CHART, "--set", "operator.replicas=2", check=False)
    assert too_many.returncode and "operator.replicas > 1 needs operator.peering: true" in too_many.stderr


def test_rendered_chart_applies_to_the_api_server(crds):
    out = crds.helm("template", "slofleet", CHART, "--namespace", "chart-dry-run").stdout
    crds.kubectl("create", "namespace", "chart-dry-run", check=False)
    r = crds.kubectl("apply", "--dry-run=server", "-n", "chart-dry-run", "-f", "-", input=out)
    assert "created (server dry run)" in r.stdout


def _operator_is_least_privilege(cluster, role: str) -> None:
    rules = cluster.get("clusterrole", role)["rules"]
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in rules)
    # Secrets and NetworkPolicies: each LLMService's trust boundary (its token, who may reach its engines).
    touches = {(g, res): r["verbs"] for r in rules for g in r["apiGroups"] for res in r["resources"]}
    for kind in (("", "secrets"), ("networking.k8s.io", "networkpolicies")):
        assert touches[kind] == ["get", "list", "watch", "create", "update", "patch", "delete"]
    # It may bind the routers' ClusterRole, and no other, without holding that role's rules.
    assert [r.get("resourceNames") for r in rules if "bind" in r["verbs"]] == [["slofleet-router"]]
    router = cluster.get("clusterrole", "slofleet-router")["rules"]
    assert router == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["get", "list", "watch"]}]


def _autoscaler_is_least_privilege(cluster, role: str) -> None:
    # It reads services and pods and writes only its status entry and Events: never a Deployment.
    writes = {(g, res) for r in cluster.get("clusterrole", role)["rules"] for g in r["apiGroups"]
              for res in r["resources"] if set(r["verbs"]) - {"get", "list", "watch"}}
    assert writes == {("slofleet.dev", "llmservices/status"), ("", "events")}


def test_kubectl_apply_k_manifests(crds):
    t0 = time.monotonic()
    crds.kubectl("apply", "-k", str(REPO / "manifests"))
    dep = crds.get("deployment", "slofleet-operator", NS)
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert "--standalone" in pod["containers"][0]["args"]
    # The autoscaler's namespace (for the NetworkPolicies) is the operator's own, whatever kustomize names it.
    assert {"name": "SLOFLEET_AUTOSCALER_NAMESPACE",
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}} \
        in pod["containers"][0]["env"]
    assert crds.get("clusterrolebinding", "slofleet-operator")["subjects"][0]["namespace"] == NS
    _operator_is_least_privilege(crds, "slofleet-operator")
    scaler = crds.get("deployment", "slofleet-autoscaler", NS)["spec"]["template"]["spec"]
    assert scaler["serviceAccountName"] == "slofleet-autoscaler"
    assert scaler["containers"][0]["args"] == ["--kubernetes"]
    _autoscaler_is_least_privilege(crds, "slofleet-autoscaler")
    # The namespace enforces the restricted pod security standard, so a pod got created at all only if the
    # operator's pod spec meets it.
    if crds.local:
        wait_until("the operator pod", lambda: crds.items("pods", NS, "app.kubernetes.io/name=slofleet-operator"))
        wait_until("the autoscaler pod", lambda: crds.items("pods", NS, "app.kubernetes.io/name=slofleet-autoscaler"))
    crds.kubectl("delete", "-k", str(REPO / "manifests"), "--wait=true", "--timeout=120s")
    apply_crds(crds)  # deleting the install removed the CRDs the other tests use
    log(f"phase kubectl apply -k manifests + delete: {time.monotonic() - t0:.1f}s")


def test_helm_install_and_uninstall(crds):
    t0 = time.monotonic()
    crds.helm("install", "slofleet", CHART, "--namespace", "slofleet-helm", "--create-namespace", "--wait=false")
    assert crds.helm("status", "slofleet", "--namespace", "slofleet-helm").stdout.count("STATUS: deployed") == 1
    dep = crds.get("deployment", "slofleet-operator", "slofleet-helm")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == CONTROL_IMAGE
    _operator_is_least_privilege(crds, "slofleet-operator")
    assert crds.get("deployment", "slofleet-autoscaler", "slofleet-helm") is not None
    _autoscaler_is_least_privilege(crds, "slofleet-autoscaler")
    crds.helm("uninstall", "slofleet", "--namespace", "slofleet-helm", "--wait", "--timeout", "120s")
    assert crds.get("deployment", "slofleet-operator", "slofleet-helm") is None
    assert crds.get("clusterrole", "slofleet-operator") is None
    assert crds.get("deployment", "slofleet-autoscaler", "slofleet-helm") is None
    # `helm uninstall --wait` waits for what the release created; the operator's pod is removed after that by
    # the garbage collector and the node's graceful termination, so it may still be terminating here.
    wait_until("the release's pods to go", lambda: not crds.items("all", "slofleet-helm",
                                                                   "app.kubernetes.io/instance=slofleet"), 120)
    # CRDs outlive the release (Helm never deletes them): LLMServices survive an uninstall.
    assert crds.get("crd", "llmservices.slofleet.dev") is not None
    log(f"phase helm install + uninstall: {time.monotonic() - t0:.1f}s")
