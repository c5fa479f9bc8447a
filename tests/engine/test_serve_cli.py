"""`slofleet serve` refuses a bad flag with one line and exit code 2 before it loads anything, and ends with exit code 1
and one line when the engine cannot start (a model that is not there, an address it cannot bind), instead of staying
up unable to serve."""
from __future__ import annotations

import subprocess
import sys

import pytest

from slofleet.engine.server import cli
from tests.support import ROOT, refused


@pytest.mark.parametrize("argv, says", [
    (["--port", "70000"], "--port must be 1-65535"),
    (["--grace-period", "-1"], "--grace-period must be 0 or more"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be at least 1"),
    (["--kv-events-endpoint", "foo"], "--kv-events-endpoint must be a ZMQ address"),
    (["--kv-events-endpoint", "tcp://127.0.0.1"], "--kv-events-endpoint must be a ZMQ address"),
    (["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-replay-endpoint", "udp://x:1"],
     "--kv-events-replay-endpoint must be a ZMQ address"),
    (["--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"], "needs --kv-events-endpoint"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
])
def test_a_bad_flag_is_one_line_and_exit_2(capsys, argv, says):
    refused(cli, argv, says, capsys)


def test_an_engine_that_cannot_start_exits_1_with_the_reason():
    done = subprocess.run([sys.executable, "-m", "slofleet.cli", "serve", "--port", "18391", "--model",
                           "/nonexistent/model"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("slofleet serve: the engine did not start: --model '/nonexistent/model'"), last
