"""The Grafana dashboard against Grafana's own schema (the Grafana Foundation SDK's strict parser and validation,
built from its Go module by tests/monitoring/grafana_schema/build.sh), not against a hand-written check."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from slofleet.api import dashboard

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def schema() -> str:
    built = subprocess.run([str(HERE / "grafana_schema" / "build.sh")], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr
    return built.stdout.strip()


def test_shipped_dashboards_pass_grafanas_schema(schema):
    files = [str(folder / "slofleet.json") for folder in dashboard.targets()]
    out = subprocess.run([schema, *files], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(": valid") == len(files)


def test_the_validator_refuses_what_grafana_would(schema, tmp_path):
    board = json.loads(dashboard.render())
    cases = {"no-annotations": {k: v for k, v in board.items() if k != "annotations"},
             "unknown-field": board | {"panelz": []},
             "wrong-type": board | {"editable": "yes"}}
    for name, bad in cases.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(bad))
        out = subprocess.run([schema, str(tmp_path / f"{name}.json")], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and ": valid" not in out.stdout, (name, out.stdout)
