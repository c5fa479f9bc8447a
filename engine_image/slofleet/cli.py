"""`slofleet <role>`: one CLI for every component. Each subcommand imports its component only when it runs,
so the operator and autoscaler never import torch, and a role whose extra is not installed says which one."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
from dataclasses import dataclass


@dataclass(slots=True, kw_only=True, frozen=True)
class Command:
    module: str  # has add_arguments(parser) and run(args) -> int
    help: str
    extra: str  # the optional dependencies it needs: pip install 'slofleet[<extra>]'


COMMANDS = {
    "serve": Command(module="slofleet.engine.server.cli", extra="engine",
                     help="run an engine: OpenAI-compatible API over the embedded or a local model"),
    "operator": Command(module="slofleet.operator.cli", extra="control",
                        help="run the kopf operator that reconciles LLMService resources"),
    "autoscaler": Command(module="slofleet.autoscaler.cli", extra="control", help="run the SLO-driven autoscaler"),
    "simulate": Command(module="slofleet.autoscaler.simulate_cli", extra="control",
                        help="replay traces through the fleet simulator"),
    "export-hf": Command(module="slofleet.engine.export", extra="engine",
                         help="write the embedded (or a given) model as a Hugging Face directory that vLLM and "
                         "transformers load"),
    "router": Command(module="slofleet.router.cli", extra="router",
                      help="run the bucket/priority-aware router in front of engines"),
    "bench": Command(module="slofleet.bench.cli", extra="bench",
                     help="replay a trace or a synthetic mix against an OpenAI-compatible URL, open-loop; "
                     "per-bucket latency percentiles, attainment and goodput"),
    "trace": Command(module="slofleet.tracing.waterfall", extra="bench",
                     help="print one request's trace as a waterfall (from a router or an engine)"),
    "diagnose": Command(module="slofleet.autoscaler.diagnose_cli", extra="control",
                        help="say which clock, bucket and phase misses its SLO, from metrics"),
}
# Import names that differ from their distribution's name.
DISTRIBUTIONS = {"zmq": "pyzmq", "yaml": "pyyaml", "opentelemetry": "opentelemetry-sdk"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extras_of(requires: list[str]) -> dict[str, set[str]]:
    """Extra -> the distributions it installs, with those of the extras it names (`slofleet[router]`)."""
    direct: dict[str, set[str]] = {}
    for line in requires:
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", line)
        name = re.match(r"\s*([A-Za-z0-9._-]+)(?:\[([^\]]*)\])?", line)
        if extra and name:
            own = _norm(name[1]) == "slofleet" and name[2]
            direct.setdefault(extra[1], set()).update(
                {f"[{e.strip()}]" for e in name[2].split(",")} if own else {_norm(name[1])})

    def expand(extra: str, seen: frozenset[str]) -> set[str]:
        out = set()
        for d in direct.get(extra, ()):
            if not d.startswith("["):
                out.add(d)
            elif d[1:-1] not in seen:
                out |= expand(d[1:-1], seen | {extra})
        return out

    return {e: expand(e, frozenset()) for e in direct}


def extra_for(module: str, command: Command, requires: list[str]) -> str:
    """The extra that installs `module`: the command's own where it does, else the first that lists it."""
    top = module.split(".")[0]
    dist = _norm(DISTRIBUTIONS.get(top, top))
    having = [e for e, dists in extras_of(requires).items() if dist in dists]
    return command.extra if command.extra in having or not having else having[0]


def missing(name: str, command: Command, e: ModuleNotFoundError) -> str:
    """One line that names the extra to install."""
    try:
        requires = importlib.metadata.requires("slofleet") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        requires = []
    extra = extra_for(e.name or "", command, requires)
    return (f"slofleet {name}: needs the '{extra}' extra ({e.name} is not installed): "
            f"pip install 'slofleet[{extra}]'")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="slofleet", description="LLM serving fleets with per-bucket SLOs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"slofleet: unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    command = COMMANDS[argv[0]]
    try:  # a role's dependencies are imported when it loads, or later (e.g. the precise router's tokenizer)
        module = importlib.import_module(command.module)
        cmd = argparse.ArgumentParser(prog=f"slofleet {argv[0]}", description=command.help)
        module.add_arguments(cmd)
        return int(module.run(cmd.parse_args(argv[1:])) or 0)
    except ModuleNotFoundError as e:
        if not e.name or e.name.split(".")[0] == "slofleet":
            raise
        print(missing(argv[0], command, e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
