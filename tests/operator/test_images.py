"""One source for the images' names (slofleet.api.images): the operator's defaults come from it, and the chart,
the manifests, the generated CRDs and the release version mirror it."""
from __future__ import annotations

import re

import yaml

from slofleet.api.images import CONTROL_IMAGE, CONTROL_REPOSITORY, ENGINE_IMAGE, TAG
from tests.operator.test_reconcile_logic import build, engine, svc
from tests.support import ROOT

CHART = ROOT / "charts" / "slofleet"
PRECISE = {"policy": "precise", "resources": {"limits": {"memory": "2Gi"}}}


def router_image(spec: dict) -> str:
    return build(svc(spec))["Deployment/s-router"]["spec"]["template"]["spec"]["containers"][0]["image"]


def test_the_tag_is_the_release():
    assert re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1] == TAG
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == TAG


def test_the_chart_runs_the_operator_and_autoscaler_on_the_control_image():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["image"]
    assert values["repository"] == CONTROL_REPOSITORY and values["tag"] == ""  # "": the appVersion, i.e. TAG
    helper = '{{- define "slofleet.image" -}}{{ .Values.image.repository }}:' \
             '{{ default .Chart.AppVersion .Values.image.tag }}{{- end -}}'
    assert helper in (CHART / "templates" / "_helpers.tpl").read_text()
    for name in ("deployment.yaml", "autoscaler.yaml"):
        lines = [x.strip() for x in (CHART / "templates" / name).read_text().splitlines() if "image:" in x]
        assert lines == ['image: {{ include "slofleet.image" . | quote }}'], (name, lines)


def test_the_manifests_run_the_operator_and_autoscaler_on_the_control_image():
    for name in ("operator.yaml", "autoscaler.yaml"):
        docs = yaml.safe_load_all((ROOT / "manifests" / name).read_text())
        docs = [d for d in docs if d and d["kind"] == "Deployment"]
        assert [c["image"] for d in docs for c in d["spec"]["template"]["spec"]["containers"]] == [CONTROL_IMAGE]


def test_the_generated_crds_name_the_engine_image_as_slofleets_default():
    for path in ("crds", "charts/slofleet/crds", "manifests/crds"):
        crd = yaml.safe_load((ROOT / path / "slofleet.dev_llmservices.yaml").read_text())
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        image = spec["engine"]["properties"]["image"]
        # no schema default: the operator picks each runtime's image; the description says slofleet's
        assert "default" not in image and f"slofleet: {ENGINE_IMAGE}" in image["description"]
        assert "default" not in spec["router"]["properties"]["image"]  # the operator picks by policy


def test_engine_pods_run_the_engine_image_and_routers_what_their_policy_needs():
    assert engine(build(svc())).get("image") == ENGINE_IMAGE
    assert router_image({}) == CONTROL_IMAGE
    assert router_image({"router": PRECISE}) == ENGINE_IMAGE  # it loads the engines' tokenizer: torch
    mine = "registry.local/slofleet/engine:dev"
    assert router_image({"router": PRECISE, "engine": {"image": mine}}) == mine
    assert router_image({"router": {"image": "registry.local/router:1"}}) == "registry.local/router:1"
