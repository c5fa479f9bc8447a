"""`pip install .[control]` gives the operator and autoscaler without torch, triton or transformers, and
`slofleet <role>` names the extra a role lacks in one line."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slofleet import cli
from tests.support.images import build_steps

HEAVY = ["torch", "triton", "transformers"]
# As hatchling writes pyproject.toml's extras into the package's metadata.
REQUIRES = ['pydantic>=2.7', 'aiohttp>=3.9; extra == "router"', 'pyzmq>=25; extra == "router"',
            'slofleet[router]; extra == "control"', 'kopf>=1.37; extra == "control"',
            'slofleet[router]; extra == "engine"', 'torch>=2.5; extra == "engine"',
            "uvicorn[standard]>=0.29; extra == 'engine'", 'matplotlib>=3.8; extra == "bench"']


def run(py: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([py, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_the_control_image_installs_exactly_the_control_extra():
    assert build_steps("control") == [["pip", "install", ".[control]"]]


def test_control_install_runs_the_operator_and_autoscaler_without_torch(control_venv, tmp_path):
    probe = f"import importlib.util as u; print(' '.join(m for m in {HEAVY!r} if u.find_spec(m)))"
    assert run(control_venv, "-c", probe, cwd=tmp_path).stdout.split() == []
    imports = ("import slofleet.operator.handlers, slofleet.autoscaler.kubemode, slofleet.router.proxy, sys; "
               f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    r = run(control_venv, "-c", imports, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    slofleet = control_venv.parent / "slofleet"
    for role in ("operator", "autoscaler", "simulate", "diagnose", "router"):
        r = run(slofleet, role, "--help", cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: slofleet {role}"), r.stdout + r.stderr


def test_a_role_without_its_extra_says_which_to_install(control_venv, tmp_path):
    r = run(control_venv.parent / "slofleet", "serve", "--help", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("slofleet serve: needs the 'engine' extra (torch is not installed): "
                        "pip install 'slofleet[engine]'\n")


def test_the_precise_router_needs_the_engine_image(control_venv, tmp_path):
    # It loads the engines' tokenizer (torch, transformers): the operator gives it the engines' image.
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    r = run(control_venv.parent / "slofleet", "router", "--host", "127.0.0.1", "--port", port,
            "--upstream", "http://127.0.0.1:9", "--policy", "precise", "--model", "default",
            "--kv-events-endpoint", "tcp://{host}:5557", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        "slofleet router: needs the 'engine' extra (torch is not installed): pip install 'slofleet[engine]'")


@pytest.mark.parametrize("module, role, extra", [
    ("torch", "serve", "engine"),
    ("torch.nn", "router", "engine"),  # the precise policy loads the engines' tokenizer
    ("zmq", "router", "router"),  # its own extra, though engine and control install it too
    ("aiohttp", "operator", "control"),  # through slofleet[router]
    ("kopf", "operator", "control"),
    ("uvicorn", "serve", "engine"),
    ("matplotlib", "simulate", "bench"),  # --png
    ("not_listed_anywhere", "autoscaler", "control"),
])
def test_the_missing_module_names_the_extra_that_installs_it(module, role, extra):
    assert cli.extra_for(module, cli.COMMANDS[role], REQUIRES) == extra


def test_the_dispatcher_reports_a_missing_dependency_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "needs_absent.py").write_text("import absent_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "fake", cli.Command(module="needs_absent", help="x", extra="bench"))
    assert cli.main(["fake", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'bench' extra (absent_dependency_xyz is not installed)" in err
    sys.modules.pop("needs_absent", None)


def test_a_missing_slofleet_module_is_a_bug_not_an_extra(tmp_path, monkeypatch):
    (tmp_path / "needs_own.py").write_text("import slofleet.no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "fake", cli.Command(module="needs_own", help="x", extra="control"))
    with pytest.raises(ModuleNotFoundError):
        cli.main(["fake"])
