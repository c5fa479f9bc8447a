"""The router's process: its HTTP server (front.py) under uvloop where installed, draining on SIGTERM, and workers.

SIGTERM: the router drains at once (/ready and new generation requests answer 503, so clients retry on another
router pod while the endpoint leaves the Service); after `drain_delay` the listener and idle connections close and
open streams get `grace_period` more to finish; streams still open then are cut with an SSE error event. A second
signal stops at once.

Workers (`--workers N`): N processes, each a whole router (its own replica probes, balancer, quotas, prefix index
subscriptions, metrics), bound to the same port with SO_REUSEPORT so the kernel spreads connections over them: one
Python event loop tops out near a core. State is per worker and not shared: a key's quota and the admission
capacity are each worker's (so up to N times the configured ones over the pod), each worker's prefix index follows
every replica's events itself (N times the memory, the same content), and /metrics answers for the worker that
took the scrape's connection."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket

from .front import Front

log = logging.getLogger("slofleet.router")
BACKLOG = 2048  # connections waiting to be accepted: a burst of a thousand clients connecting at once fits


def serve(router, sock: socket.socket, *, head_timeout: float, max_head_bytes: int, keep_alive: float,
          drain_delay: float, grace_period: float) -> None:
    """Serve the Router on a bound socket until a signal, then drain (see above)."""
    main = run(router, sock, head_timeout, max_head_bytes, keep_alive, drain_delay, grace_period)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


async def run(router, sock: socket.socket, head_timeout: float, max_head_bytes: int, keep_alive: float,
              drain_delay: float, grace_period: float) -> None:
    loop = asyncio.get_running_loop()
    await router.start()
    # Python's cyclic collector walks every live young object each few hundred allocations: with a thousand open
    # streams that was ~15% of the router's CPU. A request leaves no cycles behind (tests/router/test_front.py), so
    # the collector runs less often, and never over what was made at start (modules, schemas).
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    front = Front(router, head_timeout, max_head_bytes, keep_alive)
    server = await loop.create_server(front.protocol, sock=sock, backlog=BACKLOG)
    sweep = asyncio.ensure_future(front.sweep())
    host, port = sock.getsockname()[:2]
    log.info("router listening on http://%s:%d (pid %d)", host, port, os.getpid())
    stop, now = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if router.draining:  # a second signal: stop now
            now.set()
            stop.set()
            return
        router.drain()
        loop.call_later(drain_delay, stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await stop.wait()
        server.close()
        front.close_idle()
        if front.tasks and not now.is_set():
            log.info("waiting up to %g s for %d open requests", grace_period, len(front.tasks))
            waits = [asyncio.ensure_future(front.idle()), asyncio.ensure_future(now.wait())]
            await asyncio.wait(waits, timeout=grace_period, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        for t in list(front.tasks):  # cut: each ends its stream with an error event
            t.cancel()
        if front.tasks:
            await asyncio.wait(list(front.tasks), timeout=5)
        for c in list(front.connections):
            c.transport.close()
    finally:
        sweep.cancel()
        await router.stop()


def fork_workers(n: int) -> int | None:
    """None in each of n forked workers (each goes on to build and serve its own router); in the parent, the exit
    status once they have all ended. The parent passes SIGTERM/SIGINT on, and stops the rest when one fails."""
    pids = set()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            return None
        pids.add(pid)

    def forward(sig: int, frame) -> None:
        for p in pids:
            os.kill(p, sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = 0
    while pids:
        pid, status = os.wait()
        pids.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code not in (0, -signal.SIGTERM, -signal.SIGINT) and not rc:
            log.error("router worker %d exited with %d: stopping the others", pid, code)
            rc = code
            forward(signal.SIGTERM, None)
    return rc


def listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A bound socket; with `reuse_port`, one of several (the workers') on the same port."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    return sock
