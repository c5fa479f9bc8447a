"""`--dtype auto` picks, on the CPU, the dtype the probe measured faster at the model's shapes, and caches it."""
from __future__ import annotations

import json

import torch

from slofleet.engine.backends.cpu import dtype_probe

HIDDEN, INTER = 576, 1536  # SmolLM2-135M's projection shapes


def test_auto_picks_what_the_probe_measured_faster(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOFLEET_CACHE", str(tmp_path))
    choice = dtype_probe.choose("auto", torch.device("cpu"), HIDDEN, INTER)
    assert choice.reason == "probe" and set(choice.gflops) == {"float32", "bfloat16"}
    seconds = {d: dtype_probe.step_seconds(f, HIDDEN, INTER) for d, f in choice.gflops.items()}
    assert choice.dtype == min(seconds, key=seconds.get)
    cached = json.loads((tmp_path / "dtype-probe.json").read_text())
    assert [c["dtype"] for c in cached.values()] == [choice.dtype]


def test_the_decision_follows_the_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOFLEET_CACHE", str(tmp_path))
    slow, fast = {"prefill": 50.0, "decode": 20.0}, {"prefill": 200.0, "decode": 100.0}
    for faster in ("float32", "bfloat16"):
        (tmp_path / "dtype-probe.json").unlink(missing_ok=True)
        monkeypatch.setattr(dtype_probe, "probe", lambda h, i, f=faster: {
            d: (fast if d == f else slow) for d in dtype_probe.CANDIDATES})
        assert dtype_probe.choose("auto", torch.device("cpu"), HIDDEN, INTER).dtype == faster
    # A cached answer is reused without probing again.
    monkeypatch.setattr(dtype_probe, "probe", lambda *_: (_ for _ in ()).throw(AssertionError("probed again")))
    assert dtype_probe.choose("auto", torch.device("cpu"), HIDDEN, INTER).dtype == "bfloat16"


def test_a_dtype_clearly_slower_after_a_round_is_timed_no_more(monkeypatch):
    calls = []

    def rate(rows, k, n, dtype, seconds=0.05, kernel=False, min_reps=3):
        calls.append(dtype)
        return 100.0 if dtype == torch.float32 else 100.0 / (2 * dtype_probe.CLEARLY)
    monkeypatch.setattr(dtype_probe, "gemm_gflops", rate)
    figures = dtype_probe.probe(HIDDEN, INTER)
    assert figures["float32"] == {"prefill": 100.0, "decode": 100.0}
    # warm-up once each, then bf16 for its two shapes in the first round only; fp32 in every round
    assert calls.count(torch.bfloat16) == 1 + 2
    assert calls.count(torch.float32) == 1 + 2 * dtype_probe.ROUNDS


def test_a_flag_or_a_gpu_needs_no_probe():
    assert dtype_probe.choose("float32", torch.device("cpu"), HIDDEN, INTER).reason == "flag"
    gpu = dtype_probe.choose("auto", torch.device("cuda"), HIDDEN, INTER)
    assert (gpu.dtype, gpu.reason) == ("bfloat16", "gpu")
