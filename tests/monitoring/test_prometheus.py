"""The chart's SLO burn rules and dashboard against the real tools: promtool lints the rules and runs unit tests
that fire each alert, and a real Prometheus scrapes a real engine and router, evaluates the rules, and answers
every dashboard query once the test has provoked the event that query shows."""
from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from slofleet.api import dashboard
from slofleet.api.contract import BUCKET_HEADER
from tests.k8s.test_monitoring import RULES_ON, helm, render  # noqa: F401 (helm is a fixture)
from tests.support import ROOT
from tests.support.prometheus import Prometheus, tool, write_rules
from tests.support.router import RouterProc
from tests.support.server import Server

MODEL = "SmolLM2-135M-Instruct"
# Targets whose event this single-process test cannot provoke, and why: each must come back empty, so that a test
# that starts to provoke one is updated with it.
NOT_PROVOKED = {
    # a retry needs a replica that fails before its first byte, or a try past its own limit on a loaded machine
    "slofleet:router_retries_total": "may or may not happen here",
    "slofleet:router_streams_cut_total": "a cut stream needs a replica that dies mid-stream",
    "slofleet:router_held_requests": "the router holds requests only while no replica is ready",
}
MAY_BE_PROVOKED = {"slofleet:router_retries_total"}


@pytest.fixture(scope="module")
def groups(helm) -> list[dict]:  # noqa: F811
    return render(helm, *RULES_ON)["PrometheusRule/slofleet-slo-burn"]["spec"]["groups"]


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=300)


def test_rules_pass_promtools_lint(groups, tmp_path):
    rules, _ = write_rules(groups, tmp_path)
    out = promtool("check", "rules", "--lint=all", "--lint-fatal", str(rules))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_each_alert_fires_and_a_healthy_service_stays_silent(groups, tmp_path):
    rules, tests = write_rules(groups, tmp_path)
    cases = yaml.safe_load(tests.read_text())["tests"]
    # every bucket with a target has a page, a ticket (where its budget allows one) and a silent case
    assert {c["name"].rsplit(" ", 1)[1] for c in cases} == {"page", "ticket", "healthy"}
    assert {c["name"].split(" ")[0] for c in cases} == {g["name"].removeprefix("slofleet-slo-") for g in groups}
    out = promtool("test", "rules", str(tests))
    assert out.returncode == 0, out.stdout + out.stderr
    # the same tests fail when an alert is expected to stay silent: the check can fail
    for case in cases:
        if case["name"].endswith(" page"):
            case["alert_rule_test"][0]["exp_alerts"] = []
            break
    tests.write_text(yaml.safe_dump({**yaml.safe_load(tests.read_text()), "tests": [case]}, sort_keys=False))
    out = promtool("test", "rules", str(tests))
    assert out.returncode != 0 and "SlofleetSLOBudgetBurn" in out.stdout + out.stderr


async def traffic(router: str, engine: str) -> None:
    """Every event a dashboard panel shows, through the router: both buckets, sampled and greedy, a repeated
    prompt (prefix hits), a burst past the router's rate limit for doc (its 429s) and the engine's two slots and
    short queue (queueing, the engine's 429s, and preemptions: two of these requests need more than its six KV
    blocks), and a stream the client drops (an abort)."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(bucket: str, prompt: str, tokens: int, **extra) -> int:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, **extra}
            r = await client.post(router + "/v1/completions", json=body, headers={BUCKET_HEADER: bucket})
            return r.status_code

        same = "Tell me about lighthouses on the northern coast and the keepers who lived there."
        assert await one("chat", same, 4, temperature=0) == 200
        assert await one("chat", same, 4, temperature=0, stream=True) == 200  # the router's TPOT is a stream's
        burst = [one("doc" if i % 2 else "chat", f"Write a long letter to friend number {i}.", 40,
                     temperature=0.7 if i % 3 else 0) for i in range(14)]
        codes = await asyncio.gather(*burst)
        assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
        body = {"model": MODEL, "prompt": "Count slowly to one hundred.", "max_tokens": 80, "stream": True}
        async with client.stream("POST", engine + "/v1/completions", json=body,
                                 headers={BUCKET_HEADER: "chat"}) as r:
            async for _ in r.aiter_lines():
                break  # drop the stream after its first event: the engine aborts the request


def panel_targets() -> list[tuple[str, str]]:
    """(panel title, expression) of every dashboard query, Grafana's variables set to this test's service."""
    board = json.loads(dashboard.render())
    subs = {"$namespace": "default", "$llmservice": "chat", "$bucket": ".*", "$__rate_interval": "2m"}
    out = []
    for p in board["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            for k, v in subs.items():
                expr = expr.replace(k, v)
            out.append((p["title"], expr))
    return out


def has_data(result: list[dict]) -> bool:
    """A value other than 0 at some instant (a range query's matrix, or an instant query's vector): a counter
    that exists but never moved shows a flat 0, which is no evidence that its panel works."""
    values = [float(v[1]) for r in result for v in r.get("values", [r.get("value")]) if v]
    return any(not math.isnan(v) and v != 0 for v in values)


def diagnose(folder, buckets: list[dict], *where: str) -> dict:
    path = folder / "buckets.yaml"
    path.write_text(yaml.safe_dump({"spec": {"buckets": buckets}}))
    out = subprocess.run([sys.executable, "-m", "slofleet.cli", "diagnose", "--buckets", str(path), "--json",
                          *where], capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_a_real_prometheus_answers_every_dashboard_query(groups, tmp_path):
    rules, _ = write_rules(groups, tmp_path)
    buckets = [{"name": "chat", "match": {"header": {BUCKET_HEADER: "chat"}}, "priority": 0,
                "slo": {"percentile": 90, "ttftMs": 40, "e2eMs": 60000}},
               {"name": "doc", "priority": 5, "admission": {"maxRequestsPerSecond": 1},
                "slo": {"percentile": 90, "ttftMs": 60000}}]
    (tmp_path / "buckets.json").write_text(json.dumps(buckets))
    engine = Server("--num-threads", "1", "--max-model-len", "512", "--max-num-seqs", "2", "--num-blocks", "6",
                    "--block-size", "16", "--max-waiting-requests", "3", "--bucket-priorities", "chat=0,doc=5",
                    "--price-per-hour", "1", log=tmp_path / "engine.log")
    router = prom = None
    try:
        engine.wait_ready()
        router = RouterProc("--upstream", engine.url, "--buckets", str(tmp_path / "buckets.json"),
                            log=tmp_path / "router.log").wait_ready()
        prom = Prometheus(tmp_path, {
            "engines": [(engine.url, {"namespace": "default", "service": "chat-unified", "pod": "chat-unified-0"})],
            "routers": [(router.url, {"namespace": "default", "service": "chat-router", "pod": "chat-router-0"})]},
            rules).wait_ready()
        deadline = time.monotonic() + 60
        while prom.targets_up() < 2:
            assert time.monotonic() < deadline, "prometheus never scraped both targets"
            time.sleep(0.5)
        start = time.time()
        asyncio.run(traffic(router.url, engine.url))
        time.sleep(4)  # a few scrapes and rule evaluations after the last event
        # as Grafana asks: over the test's time range, one point a second (a gauge shows only while it lasts)
        empty = {expr: title for title, expr in panel_targets()
                 if not has_data(prom.query_range(expr, start, time.time()))}
        missing = {e: t for e, t in empty.items() if not any(n in e for n in NOT_PROVOKED)}
        assert not missing, f"dashboard queries without data: {missing}"
        provoked = [n for n in NOT_PROVOKED if not any(n in e for e in empty) and n not in MAY_BE_PROVOKED]
        assert not provoked, f"provoked now: take {provoked} out of NOT_PROVOKED"
        # the recording rules ran: the 5m bad-request ratio of chat's 40 ms TTFT target
        assert has_data(prom.query('slofleet:slo_bad_requests:ratio_rate5m{bucket="chat", clock="ttft"}'))
        # diagnose reads the same verdict from Prometheus as from the engine and router themselves
        direct = diagnose(tmp_path, buckets, "--url", router.url)
        via = diagnose(tmp_path, buckets, "--prometheus", prom.url, "--llmservice", "default/chat")
        assert direct["bucket"] == "chat"
        assert (via["slow_clock"], via["bucket"], via["dominant"]) == (
            direct["slow_clock"], direct["bucket"], direct["dominant"]), (via, direct)
    finally:
        for p in (prom, router):
            if p:
                p.stop()
        engine.stop()
