"""Helpers that more than one test package uses; a helper one package alone uses stays in that package."""
import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


def refused(command, argv: list[str], says: str, capsys) -> None:
    """`command` (a `slofleet` subcommand's module: add_arguments, run) refuses `argv` with exit code 2 and one line
    on stderr that holds `says`."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
