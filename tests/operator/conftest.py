from pathlib import Path

import pytest

from tests.support.images import build_steps, fresh_venv, run_pip_steps


@pytest.fixture(scope="session")
def control_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with only what the control image's pip steps install (`pip install
    .[control]`, from the index and pip's cache: nothing of this test's own environment shows through). Shared
    by the control-install and Dockerfile tests, so it is installed once per session. Its python."""
    py = fresh_venv(tmp_path_factory.mktemp("control") / "venv")
    run_pip_steps(py, build_steps("control"))
    return py
