"""`slofleet serve`: flags generated from EngineConfig and ServerSettings (their one source), uvicorn with draining."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading

from ..config import EngineConfig
from .lifecycle import cut_open_requests
from .settings import ServerSettings, kv_pool_problem


def _add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        meta = dict(f.metadata)
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=meta.get("help"))
        else:
            parser.add_argument(flag, type=type(default), default=default, help=meta.get("help"),
                                choices=meta.get("choices"))


def _from_args(cls: type, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_fields(parser, ServerSettings)
    _add_fields(parser, EngineConfig)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .api import build_app

    try:
        settings, config = _from_args(ServerSettings, args), _from_args(EngineConfig, args)
        problem = kv_pool_problem(config.kv_cache_memory_gb, config.num_blocks)
        if problem:
            raise ValueError(problem)
    except ValueError as e:
        print(f"slofleet serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config, settings)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: /ready and new requests get 503 at once; after the drain delay the listener
        closes and in-flight requests get the rest of the grace period to finish. Just before it ends, those
        still open are answered with an error (uvicorn would cancel them without a word)."""
        signalled = False  # not state.draining: an engine the operator drained still gets its grace period

        def handle_exit(self, sig: int, frame) -> None:
            state = app.state.slofleet
            if self.signalled:  # a second signal: stop now
                return super().handle_exit(sig, frame)
            self.signalled = state.draining = True
            threading.Timer(settings.drain_delay, super().handle_exit, (sig, frame)).start()
            cut = settings.drain_delay + max(0.0, settings.grace_period - min(1.0, settings.grace_period / 4))
            timer = threading.Timer(cut, lambda: state.async_engine and state.async_engine.loop.call_soon_threadsafe(
                cut_open_requests, state))
            timer.daemon = True  # an engine done earlier exits without waiting for it
            timer.start()

    server = DrainingServer(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                           timeout_graceful_shutdown=settings.grace_period))
    state = app.state.slofleet
    state.on_load_failure = lambda: setattr(server, "should_exit", True)
    state.freeze_gc = True
    server.run()
    if state.load_error is not None:
        print(f"slofleet serve: the engine did not start: {state.load_error}", file=sys.stderr)
        return 1
    return 0
