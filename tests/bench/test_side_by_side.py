"""`slofleet bench --runtimes`: the runtimes it takes, the one line it refuses others with, and its one table of
several runtimes' figures (the runs themselves start the real servers: docs/benchmarks.md)."""
from __future__ import annotations

import pytest

from slofleet.bench import cli, runtimes
from slofleet.bench.loadgen import Result
from slofleet.bench.report import summary
from slofleet.bench.workload import Target
from tests.support import refused


@pytest.mark.parametrize("runtimes_flag, says", [
    ("slofleet,tgi", "--runtimes: unknown runtime 'tgi' (give some of slofleet, vllm, llamacpp)"),
    ("vllm", "--runtimes: vllm is not installed in"),
])
def test_runtimes_it_cannot_start_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, runtimes_flag, says):
    monkeypatch.setenv("SLOFLEET_RUNTIMES_CACHE", str(tmp_path))  # nothing installed there
    refused(cli, ["--rate", "1", "--num-prompts", "2", "--runtimes", runtimes_flag], says, capsys)


def test_one_table_a_row_per_runtime_and_bucket():
    target = {"chat": Target(ttft=0.5, tpot=0.05, e2e=None, percentile=90)}
    fast = [Result("chat", 200, ttft=0.1, tpot=0.01, e2e=0.5, tokens=9, start=i) for i in range(4)]
    slow = [Result("chat", 200, ttft=0.9, tpot=0.01, e2e=2.0, tokens=9, start=i) for i in range(4)]
    figures = {name: summary(rs, 4.0, [50, 99], target, {}) for name, rs in (("slofleet", fast), ("vllm", slow))}
    lines = runtimes.side_table(figures, [50, 99]).splitlines()
    assert lines[0].split()[:4] == ["runtime", "bucket", "done", "fail"]
    rows = {(line.split()[0], line.split()[1]): line for line in lines[1:]}
    assert set(rows) == {("slofleet", "chat"), ("slofleet", "all"), ("vllm", "chat"), ("vllm", "all")}
    assert "100.0%" in rows["slofleet", "chat"] and "0.0%" in rows["vllm", "chat"]
    assert "100/100" in rows["slofleet", "chat"] and "900/900" in rows["vllm", "chat"]  # TTFT p50/p99 ms


def test_vllm_on_cpu_gets_a_block_size_its_attention_takes():
    """The flags a benchmark and a pod share: vLLM 0.32.0's CPU attention exits at start on 16-token blocks."""
    from slofleet.api.runtime import Serving, vllm_flags

    def block(**kw) -> str:
        args = vllm_flags(Serving(model="m", host="h", port=1, served_name="s", max_num_seqs=4,
                                  max_num_batched_tokens=64, max_model_len=256, **kw))
        return args[args.index("--block-size") + 1]

    assert (block(block_size=16), block(block_size=32), block(block_size=48)) == ("32", "32", "64")
    assert block(block_size=16, gpus=1) == "16"
