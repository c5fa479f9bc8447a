"""engine_image/Dockerfile without a container engine: its `RUN pip install` steps in a fresh virtual
environment, then `slofleet serve --help` and `slofleet operator --help` from it."""
from __future__ import annotations

import shlex
import site
import subprocess
import venv
from pathlib import Path

from tests.support import ROOT


def pip_steps() -> list[list[str]]:
    steps = []
    for line in (ROOT / "engine_image" / "Dockerfile").read_text().splitlines():
        if line.startswith("RUN pip install"):
            steps.append(shlex.split(line.removeprefix("RUN ")))
    return steps


def test_dockerfile_install_steps_give_a_working_cli(tmp_path: Path):
    steps = pip_steps()
    assert [s[:2] for s in steps] == [["pip", "install"]] * 2
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # The heavy dependencies (torch, ...) come from this test's own environment through a .pth file, so the
    # steps resolve them as already installed instead of downloading gigabytes; slofleet itself is built and
    # installed from the source tree as `pip install .` does in the image.
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "_outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    for step in steps:
        r = subprocess.run([py, "-m", *step, "--quiet", "--no-build-isolation"] if step[-1] == "." else
                           [py, "-m", *step, "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{step}: {r.stdout}\n{r.stderr}"
    cli = env_dir / "bin" / "slofleet"
    where = subprocess.run([py, "-c", "import slofleet.api, slofleet.operator.cli; print(slofleet.api.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert str(env_dir) in where, where  # the installed copy, not the editable source tree
    for sub in ("serve", "operator"):
        r = subprocess.run([cli, sub, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode == 0 and "usage: slofleet" in r.stdout, r.stdout + r.stderr
