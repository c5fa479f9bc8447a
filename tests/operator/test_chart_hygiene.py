"""Chart hygiene (issue 46): every Deployment of the chart and of manifests/ has a readiness probe, ephemeral-storage
requests and limits, a bounded /tmp and a NetworkPolicy selecting its pods, and both installs agree."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slofleet.api.contract import SERVICE_LABEL
from slofleet.operator.trust import AUTOSCALER_LABELS, OPERATOR_LABELS

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "slofleet"
MANIFESTS = [REPO / "manifests" / "operator.yaml", REPO / "manifests" / "autoscaler.yaml"]


@pytest.fixture(scope="module")
def helm() -> str:
    built = subprocess.run([str(REPO / "tests" / "cluster" / "build.sh")], capture_output=True, text=True, check=True)
    return built.stdout.strip() + "/helm"


def render(helm: str, *args: str) -> list[dict]:
    out = subprocess.run([helm, "template", "slofleet", str(CHART), "--namespace", "slofleet-system", *args],
                         capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def manifests() -> list[dict]:
    return [d for f in MANIFESTS for d in yaml.safe_load_all(f.read_text()) if d]


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def selects(policy: dict, deployment: dict) -> bool:
    wanted = policy["spec"]["podSelector"]["matchLabels"].items()
    return wanted <= deployment["spec"]["template"]["metadata"]["labels"].items()


def assert_hygienic(docs: list[dict]) -> None:
    deployments, policies = of_kind(docs, "Deployment"), of_kind(docs, "NetworkPolicy")
    assert set(deployments) == {"slofleet-operator", "slofleet-autoscaler"}
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]["spec"]
        for c in pod["containers"]:
            assert c.get("readinessProbe"), f"{name}/{c['name']}: no readiness probe"
            assert "ephemeral-storage" in c["resources"]["requests"], name
            assert "ephemeral-storage" in c["resources"]["limits"], name
        assert all(v["emptyDir"].get("sizeLimit") for v in pod["volumes"] if "emptyDir" in v), name
        mine = [p for p in policies.values() if selects(p, dep)]
        assert len(mine) == 1, f"{name}: {len(mine)} NetworkPolicies select its pods"
        assert mine[0]["spec"]["policyTypes"] == ["Ingress", "Egress"], name


def egress_pods(policy: dict) -> list[dict]:
    return [peer["podSelector"] for rule in policy["spec"]["egress"] for peer in rule.get("to", [])
            if "podSelector" in peer]


def test_chart_deployments_are_hygienic(helm):
    assert_hygienic(render(helm))


def test_manifests_deployments_are_hygienic():
    assert_hygienic(manifests())


def test_chart_and_manifests_agree(helm):
    chart, plain = render(helm), manifests()
    for name, dep in of_kind(chart, "Deployment").items():
        ours = dep["spec"]["template"]["spec"]["containers"][0]
        theirs = of_kind(plain, "Deployment")[name]["spec"]["template"]["spec"]["containers"][0]
        assert ours["readinessProbe"] == theirs["readinessProbe"], name
        assert ours["resources"] == theirs["resources"], name
    for name, policy in of_kind(chart, "NetworkPolicy").items():
        other = of_kind(plain, "NetworkPolicy")[name]["spec"]
        assert policy["spec"]["egress"] == other["egress"], name
        assert policy["spec"].get("ingress") == other.get("ingress"), name


def test_policies_reach_the_services_pods_and_the_engines_admit_them(helm):
    docs = render(helm)
    policies = of_kind(docs, "NetworkPolicy")
    for policy in policies.values():
        expr = [e for sel in egress_pods(policy) for e in sel["matchExpressions"]]
        assert {"key": SERVICE_LABEL, "operator": "Exists"} in expr  # engine and router pods of any service
    assert "ingress" not in policies["slofleet-autoscaler"]["spec"]  # it serves nothing
    ports = {p["port"] for rule in policies["slofleet-operator"]["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {"metrics", "health"}
    # The engines' NetworkPolicy (trust.py) admits pods by these labels: the chart's pods must carry them.
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in of_kind(docs, "Deployment").items()}
    assert OPERATOR_LABELS.items() <= pods["slofleet-operator"].items()
    assert AUTOSCALER_LABELS.items() <= pods["slofleet-autoscaler"].items()


def test_policy_values(helm):
    assert not of_kind(render(helm, "--set", "networkPolicy.enabled=false"), "NetworkPolicy")
    scaler = of_kind(render(helm, "--set", "autoscaler.prometheus=http://prom.monitoring:9090", "--set-json",
                            'networkPolicy.prometheusTo=[{"namespaceSelector": {}}]', "--set-json",
                            'networkPolicy.apiServerCidrs=["10.0.0.1/32"]'), "NetworkPolicy")
    egress = scaler["slofleet-autoscaler"]["spec"]["egress"]
    assert {"ports": [{"protocol": "TCP", "port": 9090}], "to": [{"namespaceSelector": {}}]} in egress
    api = next(r for r in egress if {"protocol": "TCP", "port": 6443} in r["ports"])
    assert api["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    # Without --prometheus no egress to it.
    assert not any(r.get("ports") == [{"protocol": "TCP", "port": 9090}]
                   for r in of_kind(render(helm), "NetworkPolicy")["slofleet-autoscaler"]["spec"]["egress"])


def test_autoscaler_probe_passes_only_when_the_api_server_answers(helm):
    dep = of_kind(render(helm), "Deployment")["slofleet-autoscaler"]
    command = dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    assert command[0] == "python"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        env = {**os.environ, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)}
        assert subprocess.run([sys.executable, *command[1:]], env=env, timeout=10).returncode == 0
    closed = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=10)
    assert closed.returncode != 0 and b"ConnectionRefused" in closed.stderr
