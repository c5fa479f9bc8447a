"""The chart's Grafana dashboard and SLO burn rules (values monitoring.*) and their copies in manifests/: what
renders when, and that every PromQL expression parses and selects only series that a real `slofleet serve` or
`slofleet router` exports (checked against a live scrape), or that the rules themselves record."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.utils import floatToGoString

from slofleet.api import dashboard
from slofleet.api.contract import BUCKET_HEADER, parse_samples
from tests.k8s.conftest import CLUSTER, REPO
from tests.support.router import RouterProc
from tests.support.server import Server

CHART = REPO / "charts" / "slofleet"
RULES_ON = ("--set", "monitoring.prometheusRule.enabled=true")
CATEGORIES = ["Request shape", "Queue", "Prefill", "Decode", "KV cache", "Tail", "Quality", "Cost"]
# Labels that Prometheus gives at scrape time (a ServiceMonitor's), not the exporters.
TARGET_LABELS = {"namespace", "service", "pod", "job", "__name__"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created"), "untyped": ("",)}


@pytest.fixture(scope="module")
def helm() -> str:
    built = subprocess.run([str(CLUSTER / "build.sh")], capture_output=True, text=True, check=True)
    return built.stdout.strip() + "/helm"


def render(helm: str, *args: str) -> dict[str, dict]:
    out = subprocess.run([helm, "template", "slofleet", str(CHART), "--namespace", "slofleet-system", *args],
                         capture_output=True, text=True, check=True).stdout
    return {d["kind"] + "/" + d["metadata"]["name"]: d for d in yaml.safe_load_all(out) if d}


def expressions(docs: dict[str, dict]) -> list[str]:
    """Every PromQL expression of the dashboard (panels and variables) and of the rules, Grafana's variables
    replaced by values PromQL takes."""
    out = []
    if "ConfigMap/slofleet-dashboard" in docs:
        board = json.loads(docs["ConfigMap/slofleet-dashboard"]["data"]["slofleet.json"])
        out += [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
        out += [re.fullmatch(r"label_values\((.*), \w+\)", v["query"]["query"]).group(1)
                for v in board["templating"]["list"] if v["type"] == "query"]
    if "PrometheusRule/slofleet-slo-burn" in docs:
        out += [r["expr"] for g in docs["PrometheusRule/slofleet-slo-burn"]["spec"]["groups"] for r in g["rules"]]
    return [e.replace("$__rate_interval", "5m") for e in out]


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: matched value}) of each series selector in a PromQL expression."""
    found = []
    promql_parser.walk(promql_parser.parse(expr), lambda n: found.append(
        (n.name, {m.name: m.value for m in n.matchers.matchers})) if isinstance(n, promql_parser.VectorSelector)
        else None)
    return found


def test_checked_in_dashboards_match_the_generator():
    for folder in dashboard.targets():
        assert (folder / "slofleet.json").read_text() == dashboard.render(), "drifted: make crds"


def test_chart_ships_the_dashboard_and_optional_rules(helm):
    docs = render(helm)
    cm = docs["ConfigMap/slofleet-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(cm["data"]["slofleet.json"])
    assert board == json.loads(dashboard.render())
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == CATEGORIES
    assert {"namespace", "llmservice", "bucket"} <= {v["name"] for v in board["templating"]["list"]}
    assert "PrometheusRule/slofleet-slo-burn" not in docs  # the CRD is the Prometheus operator's: off by default
    assert "ConfigMap/slofleet-dashboard" not in render(helm, "--set", "monitoring.dashboard.enabled=false")
    assert not {k for k in render(helm, "--set", "monitoring.dashboard.enabled=false") if "Rule" in k}

    rules = render(helm, *RULES_ON)["PrometheusRule/slofleet-slo-burn"]
    groups = {g["name"]: g["rules"] for g in rules["spec"]["groups"]}
    assert list(groups) == ["slofleet-slo-chat", "slofleet-slo-doc"]
    chat = groups["slofleet-slo-chat"]
    # p99: the budget is 1%; chat sets TTFT and TPOT, 7 windows each; a page and a ticket alert
    assert sorted({(r["labels"]["clock"], r["record"]) for r in chat if "record" in r}) == sorted(
        (c, f"slofleet:slo_bad_requests:ratio_rate{w}") for c in ("ttft", "tpot")
        for w in ("5m", "30m", "1h", "2h", "6h", "1d", "3d"))
    alerts = {r["labels"]["severity"]: r["expr"] for r in chat if "alert" in r}
    assert "ratio_rate1h{bucket=\"chat\"} > 14.4 * (1 - 99 / 100)" in alerts["page"]
    assert "ratio_rate30m{bucket=\"chat\"} > 6 * (1 - 99 / 100)" in alerts["page"]
    assert "ratio_rate3d{bucket=\"chat\"} > 1 * (1 - 99 / 100)" in alerts["ticket"]
    # targets are read at the nearest histogram bound: TTFT 500 ms at 0.5, TPOT 50 ms between 0.04 and 0.06 at
    # the lower, doc's TTFT 4 s at 5.0 (nearer than 2.5)
    les = {(g, s[0].split("_seconds")[0], s[1]["le"]) for g, rs in groups.items() for r in rs if "record" in r
           for s in selectors(r["expr"]) if "le" in s[1]}
    assert les == {("slofleet-slo-chat", "vllm:time_to_first_token", "0.5"),
                   ("slofleet-slo-chat", "vllm:request_time_per_output_token", "0.04"),
                   ("slofleet-slo-doc", "vllm:time_to_first_token", "5.0"),
                   ("slofleet-slo-doc", "vllm:e2e_request_latency", "20.0")}
    # the manifests carry the same dashboard and the same rules
    assert (REPO / "manifests" / "dashboards" / "slofleet.json").read_text() == dashboard.render()
    manifest = yaml.safe_load((REPO / "manifests" / "prometheusrule.yaml").read_text())
    assert manifest["spec"] == rules["spec"] and manifest["metadata"]["name"] == rules["metadata"]["name"]
    bare = subprocess.run([helm, "template", "x", str(CHART), *RULES_ON, "--set-json",
                           "monitoring.prometheusRule.buckets=[]"], capture_output=True, text=True)
    assert bare.returncode and "no bucket has an slo" in bare.stderr  # rules with nothing to judge: a mistake
    kustomization = yaml.safe_load((REPO / "manifests" / "kustomization.yaml").read_text())
    assert kustomization["configMapGenerator"][0]["options"]["labels"]["grafana_dashboard"] == "1"


def test_chart_bounds_are_the_engines():
    from slofleet.engine.server.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    for name, bounds in (("latencyBounds", LATENCY_BUCKETS), ("tokenBounds", TOKEN_BUCKETS)):
        chart = re.search(r'define "slofleet\.' + name + r'" -}}([^{]*){{', helpers).group(1).split()
        assert chart == [floatToGoString(b) for b in bounds], name


def exported(text: str) -> dict[str, dict[str, set[str]]]:
    """Sample name -> label -> the values seen, for every family an exposition declares (with samples or not yet)."""
    out: dict[str, dict[str, set[str]]] = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M):
        for suffix in SUFFIXES[kind]:  # a counter's TYPE line may name it with its _total already
            out.setdefault(name.removesuffix("_total") + suffix if kind == "counter" else name + suffix, {})
    for s in parse_samples(text):
        for label, value in s.labels.items():
            out.setdefault(s.name, {}).setdefault(label, set()).add(value)
    return out


@pytest.mark.slow
def test_every_series_is_exported_by_an_engine_or_a_router(helm, tmp_path):
    engine = Server("--bucket-priorities", "chat=0,doc=5", "--price-per-hour", "1", "--max-model-len", "512",
                    log=tmp_path / "engine.log")
    router = None
    try:
        engine.wait_ready()
        router = RouterProc("--upstream", engine.url, log=tmp_path / "router.log").wait_ready()

        async def load() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"model": "SmolLM2-135M-Instruct", "prompt": "Name three rivers.", "max_tokens": 4,
                        "stream": True}
                calls = [client.post(engine.url + "/v1/completions", json=body, headers={BUCKET_HEADER: b})
                         for b in ("chat", "doc")] + [client.post(router.url + "/v1/completions", json=body)]
                assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 3

        asyncio.run(load())
        series = exported(httpx.get(engine.url + "/metrics", timeout=10).text)
        series |= exported(httpx.get(router.url + "/metrics", timeout=10).text)
    finally:
        if router:
            router.stop()
        engine.stop()
    docs = render(helm, *RULES_ON)
    recorded = {r["record"]: dict.fromkeys(("namespace", "service", "bucket", "clock"), set())
                for g in docs["PrometheusRule/slofleet-slo-burn"]["spec"]["groups"] for r in g["rules"]
                if "record" in r}
    assert {"ConfigMap/slofleet-dashboard", "PrometheusRule/slofleet-slo-burn"} <= set(docs)
    for expr in expressions(docs):
        for name, matchers in selectors(expr):
            # a selector by a `__name__=~"a|b"` alternation (the router's clock, else the engine's) needs one of them
            names = [name] if name else matchers.pop("__name__", "").split("|")
            labels = next((got for n in names if (got := series.get(n, recorded.get(n))) is not None), None)
            assert labels is not None, f"{names} is exported by neither the engine nor the router: {expr}"
            unknown = set(matchers) - set(labels) - TARGET_LABELS
            assert not unknown or not labels, f"{name} has no label {unknown}: {expr}"
            if "le" in matchers:  # a bound the histogram really has
                assert matchers["le"] in labels["le"], expr
