"""`slofleet <role>`: one CLI for every component. Each subcommand imports its component only when it runs,
so the operator and autoscaler never import torch."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS = {
    "serve": ("slofleet.engine.server.cli", "run an engine: OpenAI-compatible API over the embedded or a local model"),
    "operator": ("slofleet.operator.cli", "run the kopf operator that reconciles LLMService resources"),
    "autoscaler": ("slofleet.autoscaler.cli", "run the SLO-driven autoscaler"),
    "simulate": ("slofleet.autoscaler.simulate_cli", "replay traces through the fleet simulator"),
    "export-hf": ("slofleet.engine.export", "write the embedded (or a given) model as a Hugging Face directory "
                  "that vLLM and transformers load"),
    "router": ("slofleet.router.cli", "run the bucket/priority-aware router in front of engines"),
    "bench": ("slofleet.bench.cli", "replay a trace or a synthetic mix against an OpenAI-compatible URL, open-loop; "
              "per-bucket latency percentiles, attainment and goodput"),
    "trace": ("slofleet.tracing.waterfall", "print one request's trace as a waterfall (from a router or an engine)"),
    "diagnose": ("slofleet.autoscaler.diagnose_cli", "say which clock, bucket and phase misses its SLO, from metrics"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="slofleet", description="LLM serving fleets with per-bucket SLOs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"slofleet: unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    module_name, help_text = COMMANDS[argv[0]]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"slofleet: '{argv[0]}' is not available in this installation ({e.name} missing)", file=sys.stderr)
            return 2
        raise
    cmd = argparse.ArgumentParser(prog=f"slofleet {argv[0]}", description=help_text)
    module.add_arguments(cmd)
    return int(module.run(cmd.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
