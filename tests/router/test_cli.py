"""`slofleet router` refuses flags no setting makes sense with (an upstream it could not call, a bound below its
least) with one line and exit code 2, before it listens."""
from __future__ import annotations

import argparse

import pytest

from slofleet.router import cli
from tests.support import ROOT, refused

UP = ["--upstream", "http://127.0.0.1:1"]


@pytest.mark.parametrize("argv, says", [
    (["--upstream", "foo"], "an upstream must be http://HOST[:PORT]"),
    (["--decode-upstream", "https://engine:8000"], "an upstream must be http://HOST[:PORT]"),
    (["--upstream", "http://engine:99999"], "an upstream must be http://HOST[:PORT]"),
    (["--upstream", "http://engine:8000/v1"], "an upstream must be http://HOST[:PORT]"),
    ([*UP, "--port", "70000"], "--port must be at most 65535"),
    ([*UP, "--capacity-per-replica", "0"], "--capacity-per-replica must be at least 1"),
    ([*UP, "--workers", "0"], "--workers must be at least 1"),
    ([*UP, "--max-body-bytes", "-5"], "--max-body-bytes must be at least 1"),
    ([*UP, "--body-timeout", "0"], "--body-timeout must be above 0"),
    ([*UP, "--upstream-idle-timeout", "nan"], "--upstream-idle-timeout must be above 0"),
    ([*UP, "--min-shed-share", "2"], "--min-shed-share must be at most 1"),
    ([*UP, "--load-factor", "0.5"], "--load-factor must be at least 1"),
    ([], "give either --upstream"),
    ([*UP, "--policy", "precise", "--model", "default", "--kv-events-endpoint", "tcp://engine:5557"],
     "--kv-events-endpoint must be a ZMQ address template with {host}"),
    ([*UP, "--policy", "precise", "--model", "/nonexistent/model"], "--policy precise: --model '/nonexistent/model'"),
    ([*UP, "--buckets", str(ROOT / "README.md")], "README.md: not YAML or JSON"),
    ([*UP, "--buckets", str(ROOT / "manifests" / "examples" / "llmservice-unified.yaml"), "--port", "0"],
     "--port must be at least 1"),
])
def test_a_bad_flag_is_one_line_and_exit_2(capsys, argv, says):
    refused(cli, argv, says, capsys)


def test_the_defaults_and_the_operators_flags_pass():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.problem(parser.parse_args(UP)) is None
    assert cli.problem(parser.parse_args(["--k8s-llmservice", "ns/chat", "--hold-timeout-seconds", "0", "--rpm", "0",
                                          "--upstream", "http://10.0.0.7:8000/"])) is None
