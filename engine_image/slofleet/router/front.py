"""The router's HTTP/1.1 server: requests parsed by httptools, handed to the Router as ASGI (scope, receive, send),
and a streamed answer's chunks written from the replica connection's callback as they arrive (`Exchange.write`,
called by http1.Response.relay), with no task switch and no ASGI message per chunk. uvicorn spent about as much CPU
per stream as the rest of the router together; this is what is left of it that the router needs.

Bounds on slow clients (slowloris): a request head (request line and headers) must arrive within `head_timeout` of
the connection opening or of its first byte, and within `max_head_bytes`, or the connection is closed; an idle
kept-alive connection is closed after `keep_alive` seconds; the body has the Router's own `body_timeout` (408).
Pipelined requests are answered in order, one at a time (reading pauses meanwhile). A client slower than the
replica pauses reading from the replica (backpressure) instead of buffering without bound."""
from __future__ import annotations

import asyncio
import collections
import logging

import httptools

from .exchange import Exchange

log = logging.getLogger("slofleet.router")
BODY_HIGH_WATER = 1 << 16  # request body bytes buffered before reading the client pauses until the app takes them
DROP_LIMIT = 1 << 20  # an answered request's unread body up to this is read and dropped; a larger one closes


class Connection(asyncio.Protocol):
    def __init__(self, front: Front):
        self.front, self.loop = front, front.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = self.write_paused = self.reading_paused = False
        self.url, self.headers, self.head_bytes = b"", [], 0
        # since when a request head has been arriving, or the connection idle between requests (the front's sweep
        # closes it past its limit: no timer armed and cancelled per request)
        self.head_since: float | None = None
        self.idle_since: float | None = None
        self.drop_since: float | None = None  # since when an answered request's unread body is being dropped
        self.parsing: Exchange | None = None  # the request whose body is arriving
        self.active: Exchange | None = None  # the request being answered
        self.queue: collections.deque[Exchange] = collections.deque()  # pipelined ones after it
        self.drained: asyncio.Future | None = None

    # transport callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer, self.local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        self.front.connections.add(self)
        self.head_since = self.loop.time()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.front.connections.discard(self)
        for ex in (self.active, *self.queue):
            if ex is not None:
                ex.wake()
                if ex.on_disconnect is not None and not ex.finished:
                    ex.on_disconnect()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.idle_since = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.reject(b"HTTP/1.1 400 Bad Request", b"protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            self.reject(b"HTTP/1.1 400 Bad Request", f"malformed request: {e}".encode())
        if self.head_since is not None:  # still inside a head after this (a body's bytes are not counted)
            self.head_bytes += len(data)
            if self.head_bytes > self.front.max_head_bytes:
                self.cut(f"over {self.front.max_head_bytes} bytes")

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.active is not None and self.active.source is not None:
            self.active.source.hold()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.active is not None and self.active.source is not None:
            self.active.source.unhold()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    async def drain(self) -> None:
        if self.write_paused and not self.closed:
            self.drained = self.loop.create_future()
            await self.drained

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.headers = b"", []
        if self.head_since is None:
            self.head_since, self.head_bytes = self.loop.time(), 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.head_since = None
        expect, declared = False, 0
        for k, v in self.headers:
            if k == b"expect":
                expect = v.lower() == b"100-continue"
            elif k == b"content-length":
                declared = int(v) if v.isdigit() else 0
        ex = Exchange(self, self.parser.get_method().decode("ascii"), self.url, self.headers,
                      keep_alive=self.parser.should_keep_alive() and not self.front.closing, expect_continue=expect,
                      droppable=declared <= DROP_LIMIT, http10=self.parser.get_http_version() == "1.0")
        self.parsing = ex
        if self.active is None:
            self.start(ex)
        else:
            self.queue.append(ex)
            self.pause_reading()  # one pipelined request at a time

    def on_body(self, body: bytes) -> None:
        ex = self.parsing
        if ex.dropping:
            return
        ex.body.append(body)
        ex.buffered += len(body)
        if ex.buffered > BODY_HIGH_WATER:
            self.pause_reading()
        ex.wake()

    def on_message_complete(self) -> None:
        ex = self.parsing
        ex.complete = True
        ex.wake()
        if ex.dropping:  # the rest of an answered request's body is in: the connection waits for the next one
            self.drop_since, self.idle_since = None, self.loop.time()

    # the requests' lifecycle
    def start(self, ex: Exchange) -> None:
        self.active = ex
        self.front.handle(ex)

    def answered(self, ex: Exchange) -> None:
        """The answer is complete: the next pipelined request, or an idle connection that times out."""
        if not ex.keep_alive:
            self.transport.close()
            return
        self.active = None
        if not ex.complete:
            # answered before its body was read (a 404, a 413): the rest is dropped as it arrives, then the next
            # request, as uvicorn does; closing now would reset a connection the client may be reusing. The rest
            # must come within the keep-alive timeout (the sweep), and a large one closes instead (Exchange.write).
            ex.dropping, self.drop_since = True, self.loop.time()
            ex.body.clear()
        elif self.queue:
            self.start(self.queue.popleft())
        elif self.head_since is None:
            self.idle_since = self.loop.time()
        self.resume_body()  # reading paused on a large body the app never read, or on a pipelined request

    def reject(self, status_line: bytes, message: bytes) -> None:
        if self.active is None:
            self.transport.write(b"%s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (status_line, len(message), message))
        self.transport.close()

    def pause_reading(self) -> None:
        if not self.reading_paused and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_body(self) -> None:
        if self.reading_paused and not self.queue and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    def cut(self, why: str) -> None:
        log.info("closing a connection from %s: request head %s", self.peer, why)
        self.head_since = None
        self.transport.close()


class Front:
    """The server's state: its connections (idle ones close at shutdown) and the requests being handled."""

    def __init__(self, app, head_timeout: float, max_head_bytes: int, keep_alive: float):
        self.app, self.head_timeout, self.max_head_bytes = app, head_timeout, max_head_bytes
        self.keep_alive = keep_alive
        self.loop = asyncio.get_running_loop()
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.closing = False  # answers from now on close their connection

    def protocol(self) -> Connection:
        return Connection(self)

    def handle(self, ex: Exchange) -> None:
        task = self.loop.create_task(self.run(ex))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, ex: Exchange) -> None:
        try:
            await self.app(ex.scope, ex.receive, ex.send)
        except asyncio.CancelledError:
            pass  # the shutdown's grace period ran out (the Router has ended a started stream with an error event)
        except Exception:
            log.exception("error answering %s %s", ex.method, ex.scope["path"])
        finally:
            del ex.scope["extensions"]  # it holds the Exchange: no cycle left for the collector
        if ex.finished or ex.conn.closed:
            return
        if ex.started:  # cut short: the client must not take it for a whole answer
            ex.conn.transport.abort()
        else:
            await ex.send({"type": "http.response.start", "status": 500,
                           "headers": [(b"content-type", b"text/plain")]})
            await ex.send({"type": "http.response.body", "body": b"internal error"})

    async def sweep(self) -> None:
        """Close connections whose request head is late or that sat idle too long, a few times per limit."""
        tick = min(0.5, self.head_timeout / 4, self.keep_alive / 4)
        while True:
            await asyncio.sleep(tick)
            now = self.loop.time()
            for c in list(self.connections):
                if c.head_since is not None and now - c.head_since > self.head_timeout:
                    c.cut("not received in time")
                elif (c.idle_since is not None and now - c.idle_since > self.keep_alive
                      or c.drop_since is not None and now - c.drop_since > self.keep_alive):
                    c.transport.close()

    async def idle(self) -> None:
        """Until no request is being handled."""
        while self.tasks:
            await asyncio.wait(list(self.tasks))

    def close_idle(self) -> None:
        self.closing = True
        for c in list(self.connections):
            if c.active is None:
                c.transport.close()
