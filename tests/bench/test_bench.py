"""`slofleet bench`: workloads (a real trace time-scaled, the synthetic mix, buckets from an LLMService file), the
figures against SLOs, and a short open-loop run against a real engine: vLLM's JSON fields, per-bucket attainment,
progress on stderr and the PNG."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from slofleet.bench import report, workload
from slofleet.bench.loadgen import Result
from tests.support import ROOT, refused
from tests.support.server import Server

SERVICE = {"apiVersion": "slofleet.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "s"}, "spec": {
    "buckets": [{"name": "chat", "match": {"maxPromptTokens": 40}, "slo": {"percentile": 90, "ttftMs": 60000}},
                {"name": "doc", "slo": {"percentile": 50, "ttftMs": 1, "e2eMs": 60000}}]}}


def test_poisson_arrivals_and_the_mix():
    items = workload.synthetic(20.0, None, 50.0, seed=1)
    assert 850 < len(items) < 1150 and items == sorted(items, key=lambda it: it.at)
    shares = {b.name: sum(it.bucket == b.name for it in items) / len(items) for b in workload.MIX}
    assert all(abs(shares[b.name] - b.share) < 0.06 for b in workload.MIX), shares
    docs = [workload.body(it, "m", "/v1/completions", False)["prompt"].split() for it in items if it.bucket == "doc"]
    head = next(b.prefix for b in workload.MIX if b.name == "doc")
    assert head and all(d[:head] == docs[0][:head] for d in docs) and len({" ".join(d) for d in docs}) == len(docs)
    assert all(len(d) == it.prompt_tokens for d, it in zip(docs, [it for it in items if it.bucket == "doc"]))
    assert [it.at for it in workload.synthetic(float("inf"), 5, None, 0)] == [0.0] * 5


def test_a_trace_is_time_scaled_to_the_rate_and_clipped():
    recorded = workload.replay("code", None, 200, None, 0)
    fast = workload.replay("code", 50.0, 200, None, 0)
    assert [it.prompt_tokens for it in fast] == [it.prompt_tokens for it in recorded]
    from slofleet.autoscaler import traces
    speed = 50.0 / traces.load("code").rate
    assert fast[-1].at == pytest.approx(recorded[-1].at / speed)
    assert len(workload.replay("code", 50.0, None, 2.0, 0)) == sum(it.at < 2.0 for it in fast)
    workload.clip(fast, 64, 8)
    assert max(it.prompt_tokens for it in fast) == 64 and max(it.max_tokens for it in fast) <= 8


def test_buckets_and_slos_come_from_an_llmservice_file(tmp_path):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(SERVICE))
    classifier, targets = workload.targets_of(str(tmp_path / "s.yaml"))
    assert targets["chat"] == workload.Target(90, ttft=60.0) and targets["doc"].e2e == 60.0
    items = [workload.Item(0, "x", n, 8, 0) for n in (10, 400)]
    workload.classify(items, classifier, "/v1/chat/completions")
    assert [it.bucket for it in items] == ["chat", "doc"]
    text = workload.body(items[1], "m", "/v1/completions", ignore_eos=False)["prompt"]
    assert len(text.split()) == 400 and text == workload.body(items[1], "m", "/v1/completions", False)["prompt"]


def test_figures_against_the_slos():
    target = workload.Target(75, ttft=0.5, tpot=0.05)
    rs = [Result("chat", 200, ttft=0.1 * i, tpot=0.01, tokens=5, e2e=1.0, itls=[0.01] * 4, prompt_tokens=10, start=i)
          for i in range(1, 8)] + [Result("chat", 429, start=7.5)]  # 5 within, 2 too slow, 1 refused
    s = report.summary(rs, 10.0, [50, 99], {"chat": target}, {"url": "u", "model": "m", "endpoint": "e",
                                                                 "workload": "w"})
    row = s["buckets"]["chat"]
    assert (row["completed"], row["failed"], row["attainment"], row["met"]) == (7, 1, 0.625, False)
    assert row["request_goodput"] == pytest.approx(0.5) and s["request_throughput"] == pytest.approx(0.7)
    assert row["median_ttft_ms"] == pytest.approx(400) and row["p50_itl_ms"] == pytest.approx(10)
    # 20 windows over the 7.5 s requests were sent in, each request in its own
    over_time = row["attainment_over_time"]
    assert len(over_time) == 20 and over_time[-1][0] == 7.5 and over_time[0][1] is None
    assert [a for _, a in over_time if a is not None] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert "chat" in report.table(s, [50, 99])


@pytest.mark.slow
def test_bench_against_a_real_engine(tmp_path):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(SERVICE))
    engine = Server("--max-model-len", "512", log=tmp_path / "engine.log")
    try:
        engine.wait_ready()
        run = subprocess.run([sys.executable, "-m", "slofleet.cli", "bench", "--url", engine.url, "--trace",
                              "conversation", "--request-rate", "4", "--num-prompts", "6", "--max-prompt-tokens",
                              "64", "--max-output-tokens", "6", "--ignore-eos",
                              "--buckets", str(tmp_path / "s.yaml"), "--json", "--png", str(tmp_path / "b.png"),
                              "--progress-interval", "0.5"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    finally:
        engine.stop()
    assert run.returncode == 0, run.stderr
    s = json.loads(run.stdout)  # stdout is exactly one JSON object
    for field in ("completed", "duration", "request_throughput", "output_throughput", "total_input_tokens",
                  "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                  "mean_itl_ms", "mean_e2el_ms", "p90_e2el_ms", "request_goodput"):
        assert s[field] is not None, field
    assert (s["completed"], s["num_prompts"], s["total_output_tokens"]) == (6, 6, 36)
    assert s["model_id"] == "SmolLM2-135M-Instruct" and s["buckets"]["doc"]["attainment"] == 0.0  # a 1 ms TTFT
    assert s["buckets"]["doc"]["completed"] == 6 and s["buckets"]["doc"]["met"] is False
    assert "sent" in run.stderr  # progress
    png = (tmp_path / "b.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.parametrize("argv, says", [
    (["--url", "foo"], "--url must be http(s)://HOST[:PORT]"),
    (["--rate", "-1"], "--request-rate must be above 0"),
    (["--rate", "1", "--duration", "inf"], "--duration must be finite"),
    (["--rate", "1", "--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["--rate", "1", "--metric-percentiles", "50,abc"], "--metric-percentiles must be comma-separated numbers"),
    (["--rate", "1", "--buckets", "{missing}"], "--buckets: [Errno 2]"),
    (["--rate", "1", "--buckets", "{readme}"], "not YAML or JSON"),
    (["--rate", "1", "--buckets", "{bad}"], "invalid buckets: slo: slo.percentile must be > 0 and < 100"),
])
def test_a_bad_flag_or_buckets_file_is_one_line_and_exit_2(tmp_path, capsys, argv, says):
    from slofleet.bench import cli
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump([{"name": "chat", "slo": {"percentile": 150, "ttftMs": 100}}]))
    files = {"missing": tmp_path / "missing.yaml", "readme": ROOT / "README.md", "bad": bad}
    refused(cli, ["--url", "http://127.0.0.1:9", *[a.format(**files) for a in argv]], says, capsys)
