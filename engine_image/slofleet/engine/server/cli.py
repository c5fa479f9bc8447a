"""`slofleet serve`: flags generated from EngineConfig (its one source of truth), uvicorn with draining."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import threading

from ..config import EngineConfig, config_fields


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--grace-period", type=float, default=30.0,
                        help="seconds to finish in-flight requests after SIGTERM")
    parser.add_argument("--drain-delay", type=float, default=2.0,
                        help="seconds /ready reports 503 after SIGTERM before the listener closes, so load "
                             "balancers stop sending first")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=meta.get("help"))
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, help=meta.get("help"),
                                choices=meta.get("choices"))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .api import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
    except ValueError as e:
        print(f"slofleet serve: {e}")
        return 2
    app = build_app(config)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: /ready and new requests get 503 at once; after the drain delay the listener
        closes and in-flight requests get the rest of the grace period to finish."""

        def handle_exit(self, sig: int, frame) -> None:
            state = app.state.slofleet
            if state.draining:  # a second signal: stop now
                return super().handle_exit(sig, frame)
            state.draining = True
            threading.Timer(args.drain_delay, super().handle_exit, (sig, frame)).start()

    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.grace_period))
    server.run()
    return 0
