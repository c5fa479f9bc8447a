"""uvicorn around the Router: draining on SIGTERM, and bounds on slow clients.

SIGTERM: the router drains at once (/ready and new generation requests answer 503, so clients retry on another
router pod while the endpoint leaves the Service); after `drain_delay` the listener closes and open streams get
`grace_period` more to finish; streams still open then are cut with an SSE error event. A second signal stops
at once.

Slow clients (slowloris), with httptools (uvicorn[standard]): a request head (request line and headers) must
arrive within `head_timeout` of the connection opening or of its first byte, and within `max_head_bytes`, or the
connection is closed; uvicorn's keep-alive timeout closes idle connections between requests; the body has the
Router's `body_timeout` (408)."""
from __future__ import annotations

import asyncio
import logging
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
