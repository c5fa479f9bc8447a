"""engine_image/Dockerfile without a container engine: each image's `RUN pip install` steps in a fresh virtual
environment, then the roles that image runs (`--help`, and its CMD's role)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from slofleet.api.images import CONTROL_IMAGE, ENGINE_IMAGE
from tests.support.images import DOCKERFILE, build_steps, fresh_venv, run_pip_steps, stages


def helps(py: Path, roles: list[str], cwd: Path) -> None:
    for role in roles:
        r = subprocess.run([py.parent / "slofleet", role, "--help"], capture_output=True, text=True, timeout=120,
                           cwd=cwd)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: slofleet {role}"), r.stdout + r.stderr


def test_the_images_are_two_targets_and_the_engine_is_the_default():
    s = stages()
    assert list(s)[-1] == "engine" and "control" in s
    assert s["engine"].cmd[:2] == ["slofleet", "serve"] and s["control"].cmd[:2] == ["slofleet", "operator"]
    assert build_steps("engine")[0] == ["pip", "install", ".[engine]"]
    # Only the engine image gets a compiler (the CPU kernels).
    text = DOCKERFILE.read_text()
    assert text.count("g++") == 1 and text.index("g++") > text.index("AS engine\n")
    # The build commands in its header tag each target with the name the operator and the chart use.
    assert f"--target engine -t {ENGINE_IMAGE} ." in text and f"--target control -t {CONTROL_IMAGE} ." in text


def test_engine_image_steps_give_serve_and_every_router(tmp_path: Path):
    # The heavy dependencies (torch, ...) come from this test's own environment through a .pth file, so the
    # steps resolve them as already installed instead of downloading gigabytes; slofleet itself is built and
    # installed from the source tree as `pip install .[engine]` does in the image.
    py = fresh_venv(tmp_path / "venv", outer_site=[p for p in sys.path if p.endswith("site-packages")])
    run_pip_steps(py, build_steps("engine"), build_isolation=False)
    where = subprocess.run([py, "-c", "import slofleet.api, slofleet.engine.server.cli; print(slofleet.api.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert str(tmp_path / "venv") in where, where  # the installed copy, not the editable source tree
    helps(py, ["serve", "router"], tmp_path)


def test_control_image_steps_give_its_roles(control_venv: Path, tmp_path: Path):
    where = subprocess.run([control_venv, "-c", "import slofleet.api; print(slofleet.api.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert str(control_venv.parent.parent) in where, where
    helps(control_venv, ["operator", "autoscaler", "router"], tmp_path)
    cmd = stages()["control"].cmd
    r = subprocess.run([control_venv.parent / cmd[0], cmd[1], "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
