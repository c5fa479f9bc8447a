"""`make lint`'s function rule (tools/long_functions.py): a function is counted from `def` to its last line, and
each one over the limit is printed as `path:line name: N lines`, with a failing exit code."""
from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT

TOOL = ROOT / "tools" / "long_functions.py"


def function(name: str, lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 2))
    return f"{indent}def {name}():\n{body}{indent}    return 0\n"


def check(*paths, limit: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "--max", str(limit), *map(str, paths)], capture_output=True,
                          text=True, cwd=ROOT)


def test_only_functions_over_the_limit_are_listed_with_their_place_and_length(tmp_path):
    src = tmp_path / "m.py"
    # lines 1-60, 63 class C, 64-124 its method, 127 a decorator (not counted), 128 its def
    src.write_text(function("fits", 60) + "\n\nclass C:\n" + function("long_method", 61, "    ")
                   + "\n\n@decorated\n" + function("long_async", 75).replace("def ", "async def ", 1))
    r = check(src)
    assert r.returncode == 1
    assert r.stdout.splitlines()[1:] == [f"  {src}:64 long_method: 61 lines", f"  {src}:128 long_async: 75 lines"]


def test_a_file_within_the_limit_passes_quietly(tmp_path):
    src = tmp_path / "ok.py"
    src.write_text(function("a", 60) + function("b", 3))
    r = check(src)
    assert (r.returncode, r.stdout) == (0, "")
    assert check(src, limit=59).returncode == 1


def test_the_repositorys_production_code_is_within_the_limit():
    r = check()
    assert r.returncode == 0, r.stdout
