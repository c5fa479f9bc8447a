"""uvicorn around the Router: draining on SIGTERM, and bounds on slow clients.

SIGTERM: the router drains at once (/ready and new generation requests answer 503, so clients retry on another
router pod while the endpoint leaves the Service); after `drain_delay` the listener closes and open streams get
`grace_period` more to finish; streams still open then are cut with an SSE error event. A second signal stops
at once.

Slow clients (slowloris), with httptools (uvicorn[standard]): a request head (request line and headers) must
arrive within `head_timeout` of the connection opening or of its first byte, and within `max_head_bytes`, or the
connection is closed; uvicorn's keep-alive timeout closes idle connections between requests; the body has the
Router's `body_timeout` (408).

Workers (`--workers N`): N processes, each a whole router (its own replica probes, balancer, quotas, prefix index
subscriptions, metrics), bound to the same port with SO_REUSEPORT so the kernel spreads connections over them: one
Python event loop tops out near a core. State is per worker and not shared: a key's quota and the admission
capacity are each worker's (so up to N times the configured ones over the pod), each worker's prefix index follows
every replica's events itself (N times the memory, the same content), and /metrics answers for the worker that
took the scrape's connection."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("slofleet.router")


def head_limited(head_timeout: float, max_head_bytes: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, closing a connection whose request head is too slow or too large."""

    class HeadLimited(HttpToolsProtocol):
        head_timer: asyncio.TimerHandle | None = None
        head_bytes = 0

        def arm(self) -> None:
            if self.head_timer is None:
                self.head_bytes = 0
                self.head_timer = self.loop.call_later(head_timeout, self.cut, "not received in time")

        def disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def cut(self, why: str) -> None:
            log.info("closing a connection from %s: request head %s", self.client, why)
            self.disarm()
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.arm()

        def connection_lost(self, exc) -> None:
            self.disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.head_timer is not None:  # still inside a head after parsing this (a body's bytes are not counted)
                self.head_bytes += len(data)
                if self.head_bytes > max_head_bytes:
                    self.cut(f"over {max_head_bytes} bytes")

        def on_message_begin(self) -> None:  # the next request on a kept-alive connection
            self.arm()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self.disarm()
            super().on_headers_complete()

    return HeadLimited


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, router, drain_delay: float):
        super().__init__(config)
        self.router, self.drain_delay = router, drain_delay

    def handle_exit(self, sig: int, frame) -> None:
        if self.router.draining:  # a second signal: stop now
            return super().handle_exit(sig, frame)
        self.router.drain()
        threading.Timer(self.drain_delay, super().handle_exit, (sig, frame)).start()


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
        if code not in (0, -signal.SIGTERM, -signal.SIGINT) and not rc:  # uvicorn re-raises the signal it drained on
            log.error("router worker %d exited with %d: stopping the others", pid, code)
            rc = code
            forward(signal.SIGTERM, None)
    return rc


def reuse_port_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    return sock
