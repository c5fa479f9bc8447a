"""engine_image/Dockerfile read without a container engine: its stages, and their `RUN pip install` steps run in
a fresh virtual environment."""
from __future__ import annotations

import json
import shlex
import subprocess
import venv
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import ROOT

DOCKERFILE = ROOT / "engine_image" / "Dockerfile"


@dataclass(slots=True, kw_only=True)
class Stage:
    name: str
    base: str  # the image or stage it starts FROM
    pip_steps: list[list[str]] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    copies_from: list[str] = field(default_factory=list)  # the stages of its COPY --from=


def stages() -> dict[str, Stage]:
    """Each named stage, in order (the last is what `docker build` without --target gives)."""
    out: dict[str, Stage] = {}
    stage = None
    for line in DOCKERFILE.read_text().splitlines():
        words = line.split()
        if line.startswith("FROM "):
            stage = Stage(name=words[3] if len(words) > 3 else f"stage{len(out)}", base=words[1])
            out[stage.name] = stage
        elif line.startswith("RUN pip install"):
            stage.pip_steps.append(shlex.split(line.removeprefix("RUN ")))
        elif line.startswith("COPY --from="):
            stage.copies_from.append(words[1].removeprefix("--from="))
        elif line.startswith("CMD "):
            stage.cmd = json.loads(line.removeprefix("CMD "))
    return out


def build_steps(target: str) -> list[list[str]]:
    """The pip steps that make `target`: those of the stages it copies from, and of the stages they start from."""
    all_ = stages()
    steps = []
    for name in all_[target].copies_from:
        chain = []
        while name in all_:
            chain.insert(0, all_[name])
            name = all_[name].base
        steps += [step for s in chain for step in s.pip_steps]
    return steps


def fresh_venv(where: Path, outer_site: list[str] | None = None) -> Path:
    """A new virtual environment with pip; `outer_site` directories are visible in it (a .pth file). Its python."""
    venv.create(where, with_pip=True)
    py = where / "bin" / "python"
    if outer_site:
        purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        (Path(purelib) / "_outer.pth").write_text("\n".join(outer_site) + "\n")
    return py


def run_pip_steps(py: Path, steps: list[list[str]], *, build_isolation: bool = True) -> None:
    """Each `pip install ...` step as the Dockerfile runs it (from the repository root), with this python."""
    for step in steps:
        # --no-compile: the imports write what bytecode they need; compiling the whole kubernetes client up
        # front would cost more than the test's own checks.
        extra = ["--quiet", "--no-compile"] + ([] if build_isolation or not step[-1].startswith(".") else
                                               ["--no-build-isolation"])
        r = subprocess.run([py, "-m", *step, *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{step}: {r.stdout}\n{r.stderr}"
