"""The router's HTTP/1.1 client for generation requests: kept-alive connections per replica, a request head
written in one piece, and the answer parsed by httptools (C) with its body chunks handed over as the bytes that
arrived. aiohttp did the same at several times the CPU per request and per chunk (its request builder, stream
reader and a read timer re-armed on every chunk); at 1,000 open streams that was most of the router's time.

Failures are OSErrors (a refused or timed-out connect, a connection lost or a malformed answer): the caller takes
the replica out and retries elsewhere. `asyncio.TimeoutError` only ever means the idle timer of `watch`."""
from __future__ import annotations

import asyncio
import collections
import urllib.parse
from dataclasses import dataclass

import httptools

HIGH_WATER = 1 << 18  # bytes buffered from a replica before reading from it pauses (a client slower than the engine)


class Conn(asyncio.Protocol):
    """One connection to a replica, carrying one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.reset()
        self.lost: Exception | None = None
        self.home: dict[Conn, None] | None = None  # the pool's idle set while it waits there

    def reset(self) -> None:
        self.status, self.raw_headers, self.head_done, self.complete, self.keep_alive = 0, [], False, False, False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered, self.paused, self.got_any, self.last_byte = 0, False, False, 0.0
        self.waiter: asyncio.Future | None = None
        self.sink = None  # while relaying: the client's answer (exchange.Exchange), written after each read
        self.held = b""  # while relaying: the body bytes of the read being parsed
        # chunks relayed, the last two of them (an SSE stream's usage event may come in the one before its [DONE]),
        # and the SSE events among them (each ends in a blank line, which no JSON payload holds)
        self.relayed, self.tail, self.before, self.events = 0, b"", b"", 0

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def connection_made(self, transport) -> None:
        self.transport, self.loop = transport, asyncio.get_running_loop()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None and self.head_done and not self.complete and not any(
                k.lower() in (b"content-length", b"transfer-encoding") for k, _ in self.raw_headers):
            self.complete = True  # a body without length or chunks runs to the connection's end (RFC 9112 6.3)
        self.lost = exc or ConnectionResetError("the replica closed the connection")
        if self.home is not None:  # closed while idle (the replica's keep-alive timeout)
            self.home.pop(self, None)
        self.wake()

    def data_received(self, data: bytes) -> None:
        self.got_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.lost = ConnectionError(f"malformed answer from the replica: {e}")
            self.transport.abort()
            self.wake()
            return
        sink = self.sink
        if sink is not None:  # relaying: this read's body bytes in one write (with the answer's end if it came)
            body, self.held = self.held, b""
            if body or self.complete:
                self.last_byte = self.loop.time()
                if body:
                    self.seen(body)
                sink.write(body, not self.complete)

    def seen(self, body: bytes) -> None:
        # a blank line split across two reads counts too
        self.events += body.count(b"\n\n") + (body[:1] == b"\n" and self.tail[-1:] == b"\n")
        self.relayed, self.tail, self.before = self.relayed + 1, body, self.tail

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status, self.head_done = self.parser.get_status_code(), True
        self.wake()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:  # written at the end of this read
            self.held += body
            return
        self.chunks.append(body)
        self.last_byte = self.loop.time()
        self.buffered += len(body)
        if self.buffered > HIGH_WATER:
            self.hold()
        self.wake()

    def take(self) -> bytes:
        """The body bytes buffered so far, emptying the buffer."""
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        return data

    def hold(self) -> None:
        """Stop reading from the replica (its answer is read faster than the client takes it)."""
        if not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def unhold(self) -> None:
        if self.paused:  # the client caught up: the replica's silence counts from now
            self.paused, self.last_byte = False, self.loop.time()
            self.transport.resume_reading()

    def on_message_complete(self) -> None:
        self.complete, self.keep_alive = True, self.parser.should_keep_alive()  # asked now: the parser then resets
        self.wake()

    async def wait(self) -> None:
        if self.lost is not None:
            raise self.lost
        self.waiter = self.loop.create_future()
        await self.waiter
        self.waiter = None


@dataclass(slots=True, kw_only=True)
class Progress:
    """How far a relay got: the chunks relayed, the last two of them, and the SSE events among them."""
    chunks: int
    tail: bytes
    before: bytes = b""
    events: int = 0


class Response:
    def __init__(self, pool: Pool, key: tuple, conn: Conn):
        self.pool, self.key, self.conn = pool, key, conn
        self.status, self.raw_headers = conn.status, conn.raw_headers
        self.timer: asyncio.TimerHandle | None = None
        self.idle = 0.0

    def header(self, name: bytes) -> str | None:
        """A response header's value by its lower-case name (the few asked for are looked up, not all decoded)."""
        return next((v.decode("latin-1") for k, v in self.raw_headers if k.lower() == name), None)

    @property
    def content_type(self) -> str:
        return (self.header(b"content-type") or "").partition(";")[0].strip().lower()

    async def readany(self) -> bytes:
        """The body bytes arrived since the last call (waiting for some), b"" once the body is over."""
        c = self.conn
        while not c.chunks:
            if c.complete:
                return b""
            await c.wait()
        data = c.take()
        c.unhold()
        return data

    async def relay(self, sink) -> None:
        """Write the rest of the body to `sink`, its end included (front.Exchange: its `write(bytes, more)`, `slow`
        while the client is behind, and `source`, set to the connection while this runs, for it to `hold` and
        `unhold` reading as the client falls behind and catches up), returning once the body is over. Fails as
        readany does; `progress` tells what was written either way."""
        c = self.conn
        c.sink, sink.source = sink, c
        if c.chunks or c.complete:  # arrived before the relay began
            body = c.take()
            if body:
                c.seen(body)
            sink.write(body, not c.complete)
        if sink.slow:
            c.hold()
        else:
            c.unhold()
        try:
            while not c.complete:
                await c.wait()
        finally:
            c.sink = sink.source = None

    def progress(self) -> Progress:
        """How far the relay got so far; ask before `release`."""
        c = self.conn
        if c is None:
            return Progress(chunks=0, tail=b"")
        return Progress(chunks=c.relayed, tail=c.tail, before=c.before, events=c.events)

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def watch(self, idle: float) -> None:
        """From now on, `idle` seconds without a body byte end the reading with asyncio.TimeoutError: one timer
        that wakes when the silence would reach `idle` since the last byte, not a timer re-armed on every chunk.
        While reading is paused for a slow client, the replica is not the one idle."""
        c = self.conn
        c.last_byte = max(c.last_byte, c.loop.time())
        self.idle = idle
        self.timer = c.loop.call_later(idle, self.check)

    def check(self) -> None:
        c = self.conn
        if c is None or c.complete or c.lost is not None:
            return
        left = self.idle if c.paused else c.last_byte + self.idle - c.loop.time()
        if left > 0:
            self.timer = c.loop.call_later(left, self.check)
            return
        c.lost = asyncio.TimeoutError()
        c.wake()

    def release(self) -> None:
        """Done with it: a complete answer's connection goes back to the pool, any other is closed (the replica
        sees the disconnect and aborts the request)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None  # its callback is this Response's: no cycle left for the collector
        c, self.conn = self.conn, None
        if c is None:
            return
        if c.complete and not c.chunks and c.lost is None and c.keep_alive:
            c.reset()
            c.home = self.pool.idle[self.key]
            c.home[c] = None
        else:
            c.transport.abort()

    close = release  # an incomplete answer is closed either way


class Pool:
    """Kept-alive connections per replica, as many as requests in flight to it (no cap: a cap would queue
    streams behind each other)."""

    def __init__(self, connect_timeout: float, headers: dict[str, str]):
        self.connect_timeout = connect_timeout
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.idle: collections.defaultdict[tuple, dict[Conn, None]] = collections.defaultdict(dict)
        self.targets: dict[str, tuple[tuple, str]] = {}

    def target(self, url: str) -> tuple[tuple, str]:
        """((host, port), host header) of a replica's URL; engines serve plain HTTP."""
        found = self.targets.get(url)
        if found is None:
            u = urllib.parse.urlsplit(url)
            if u.scheme != "http" or not u.hostname:
                raise ConnectionError(f"not an http://host:port replica URL: {url}")
            found = self.targets[url] = ((u.hostname, u.port or 80), u.netloc)
        return found

    async def connect(self, key: tuple) -> Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(Conn, key[0], key[1]), self.connect_timeout)
        except asyncio.TimeoutError:
            raise ConnectionError(f"connecting to {key[0]}:{key[1]} took over {self.connect_timeout:g} s") from None
        return conn

    async def post(self, url: str, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send the request, wait for the answer's status and headers."""
        key, netloc = self.target(url)
        head = (f"POST {path} HTTP/1.1\r\nhost: {netloc}\r\ncontent-length: {len(body)}\r\n{self.fixed}"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode("latin-1")
        idle = self.idle[key]
        if idle:
            conn, _ = idle.popitem()  # the most recently used
            conn.home = None
            try:
                return await self.send(key, conn, head, body)
            except OSError:
                if conn.got_any:  # it answered something: a real failure, not a kept-alive connection gone
                    raise
                # the replica closed it as we wrote (its keep-alive timeout): the request never reached it
        return await self.send(key, await self.connect(key), head, body)

    async def send(self, key: tuple, conn: Conn, head: bytes, body: bytes) -> Response:
        conn.transport.write(head + body)
        try:
            while not conn.head_done:
                await conn.wait()
        except BaseException:
            conn.transport.abort()
            raise
        return Response(self, key, conn)

    def close(self) -> None:
        for conns in self.idle.values():
            for c in list(conns):
                c.transport.abort()
        self.idle.clear()
