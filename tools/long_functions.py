"""Fail when a production function is longer than the limit, counted from `def` to its last line."""

import argparse
import ast
import subprocess
import sys
from pathlib import Path

SKIPPED = ("tests/", "benchmarks/")


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, check=True).stdout
    return [Path(p) for p in out.splitlines() if not p.startswith(SKIPPED)]


def offenders(path: Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [f"{path}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1} lines"
            for f in sorted(functions, key=lambda f: f.lineno) if f.end_lineno - f.lineno + 1 > limit]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max", type=int, default=60, help="most lines a function may have")
    parser.add_argument("paths", nargs="*", type=Path, help="files to check (default: git's production .py)")
    args = parser.parse_args()
    found = [line for path in args.paths or tracked() for line in offenders(path, args.max)]
    if found:
        print(f"functions over {args.max} lines (split them):")
        print("\n".join(f"  {line}" for line in found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
