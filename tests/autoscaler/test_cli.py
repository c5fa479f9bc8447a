import argparse
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest

from slofleet.autoscaler import cli, simulate_cli, traces
from tests.support import refused


def test_the_autoscaler_never_imports_torch_nor_the_operator():
    code = ("import sys, slofleet.autoscaler.cli, slofleet.autoscaler.simulate_cli, slofleet.autoscaler.sim, "
            "slofleet.autoscaler.kubemode; "
            "bad = [m for m in ('torch', 'kopf', 'slofleet.operator') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


class Engine(BaseHTTPRequestHandler):
    """A fake engine /metrics on loopback: its queue and first tokens grow with every scrape."""
    scrapes = 0

    def do_GET(self):
        Engine.scrapes += 1
        n = Engine.scrapes
        body = (f'vllm:num_requests_waiting{{model_name="m"}} {40 * n}\n'
                f'vllm:num_requests_running{{model_name="m"}} 8\n'
                f'vllm:kv_cache_usage_perc{{model_name="m"}} 0.5\n'
                f'vllm:prompt_tokens_total{{model_name="m"}} {1000 * 10 * n}\n'
                f'vllm:time_to_first_token_seconds_bucket{{bucket="chat",le="0.5",model_name="m"}} {n}\n'
                f'vllm:time_to_first_token_seconds_bucket{{bucket="chat",le="+Inf",model_name="m"}} {10 * n}\n')
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_autoscaler_loop_holds_without_a_window_then_scales_on_a_growing_queue(capsys):
    server = HTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        url = f"http://127.0.0.1:{server.server_port}"
        args = p.parse_args(["--target", f"prefill={url}", "--interval", "0.2", "--window", "5",
                             "--iterations", "2", "--max-replicas", "8"])
        assert cli.run(args) == 0
    finally:
        server.shutdown()
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["role"] for x in lines] == ["prefill", "prefill"]
    assert lines[0]["condition"] == "MetricsStale" and lines[0]["desired"] == 1  # one scrape is no window
    # ~200 req/s of 1000-token prompts arriving: far past the 8-replica bound, so capped and reported
    assert lines[1]["desired"] == 8 and lines[1]["condition"] == "ScalingLimited"
    assert "scale up" in lines[1]["reason"] and "req/s" in lines[1]["reason"]


def test_real_traces_load_with_their_published_shape():
    conv, code, long = (traces.load(n) for n in ("conversation", "code", "long"))
    assert abs(len(conv.arrival) - 19_366) <= 1 and abs(conv.prompt.mean() - 1155) < 5
    assert abs(code.output.mean() - 28) < 1 and abs(long.prompt.mean() - 12_035) < 5
    assert 3300 < conv.duration < 3700 and np.all(np.diff(long.arrival) >= 0)


def test_synthesized_day_follows_the_diurnal_peak_and_the_requested_busiest_minute():
    day = traces.synth_day(traces.load("conversation"), peak_rate=4.0, seed=1)
    hours = np.bincount((day.arrival // 3600).astype(int), minlength=24)
    assert 1.6 < hours.max() / hours.mean() < 2.2  # published conversation peak/mean: 1.9
    minutes = np.bincount((day.arrival // 60).astype(int)) / 60
    assert 3.2 < minutes.max() < 5.0


def test_overlay_adds_load_at_real_time_and_keeps_the_bursts_length():
    code = traces.load("code")
    more = traces.overlay(code, 3.4, seed=5)
    assert abs(len(more.arrival) / len(code.arrival) - 3.4) < 0.05
    assert np.all(np.diff(more.arrival) >= 0) and 0 <= more.arrival[0] and more.arrival[-1] <= code.duration + 1e-6
    assert more.duration > 0.99 * code.duration  # not compressed, unlike scale()
    # the requests are the trace's own: each length pair occurs in it
    pairs = set(zip(code.prompt.tolist(), code.output.tolist()))
    assert set(zip(more.prompt.tolist(), more.output.tolist())) <= pairs
    # the copies are shifted: the busiest second holds fewer than 3.4x the trace's own busiest second
    per_second = lambda t: np.bincount(t.arrival.astype(int)).max()  # noqa: E731
    assert per_second(more) < 3.4 * per_second(code)
    again = traces.overlay(code, 3.4, seed=5)
    assert np.array_equal(again.arrival, more.arrival)  # a seed replays the same requests
    assert len(traces.overlay(code, 1.0, seed=5).arrival) == len(code.arrival)


@pytest.mark.parametrize("replay, faster", [("overlay", False), ("speed", True)])
def test_replay_mode_decides_whether_a_trace_is_compressed(replay, faster):
    p = argparse.ArgumentParser()
    simulate_cli.add_arguments(p)
    args = p.parse_args(["--replay", replay, "--replay-replicas", "2"])
    trace, _ = simulate_cli.scenario("code", simulate_cli.profiles.load("gpu"), args)
    base = traces.load("code")
    assert len(trace.arrival) > len(base.arrival) * 2 if not faster else len(trace.arrival) == len(base.arrival)
    assert (trace.duration < base.duration / 2) == faster


def test_simulate_prints_a_table_per_trace_and_draws_a_png(tmp_path, capsys):
    p = argparse.ArgumentParser()
    simulate_cli.add_arguments(p)
    png = tmp_path / "sim.png"
    args = p.parse_args(["--traces", "conversation", "--policies", "static-peak,slofleet,keda-queue",
                         "--replay-replicas", "2", "--png", str(png), "--jobs", "1"])
    assert simulate_cli.run(args) == 0
    out = capsys.readouterr().out
    assert "SLO TTFT 500 ms, TPOT 50 ms" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in
            ("slofleet", "keda-queue") or line.startswith("static-")]
    assert len(rows) == 3
    static = next(r for r in rows if r[0].startswith("static-"))
    assert float(static[1].rstrip("%")) >= 95.0  # static peak is the smallest count reaching the target
    assert png.stat().st_size > 10_000


def test_sweep_tries_each_baselines_main_parameter_and_marks_the_best(capsys):
    p = argparse.ArgumentParser()
    simulate_cli.add_arguments(p)
    args = p.parse_args(["--traces", "conversation", "--policies", "hpa", "--sweep", "--png", "", "--jobs", "1"])
    assert simulate_cli.run(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("hpa ")]
    assert [r[-1] if r[-1].startswith("target=") else r[-3] for r in rows] == \
        [f"target={v:g}" for v in simulate_cli.SWEEP["hpa"]]
    best = [r for r in rows if r[-1] == "best"]
    assert len(best) == 1  # the cheapest reaching the target, else the most goodput per replica-hour


@pytest.mark.parametrize("argv, says", [
    (["--target", "unified=foo"], "--target wants ROLE=URL"),
    (["--target", "gpu=http://engine:8000"], "ROLE one of unified, prefill, decode"),
    (["--target", "unified=http://engine:8000", "--interval", "-5"], "--interval must be above 0"),
    (["--target", "unified=http://engine:8000", "--ttft", "nan"], "--ttft must be above 0"),
    (["--target", "unified=http://engine:8000", "--min-replicas", "5", "--max-replicas", "2"],
     "--min-replicas (5) must not be above --max-replicas (2)"),
    (["--prometheus", "http://prometheus:9090"], "--prometheus needs --kubernetes"),
    ([], "give --kubernetes or at least one --target"),
])
def test_a_bad_flag_is_one_line_and_exit_2(capsys, argv, says):
    refused(cli, argv, says, capsys)
