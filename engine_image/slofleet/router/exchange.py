"""One request and its answer on the router's HTTP/1.1 server (front.py): the ASGI scope, receive and send the
Router is called with, and `write`, which the relay of a streamed answer (http1.Response.relay) calls from the
replica connection's callback with the bytes each read brought, framed here as HTTP/1.1 chunks."""
from __future__ import annotations

import asyncio
import collections
import http
import urllib.parse
from typing import TYPE_CHECKING

import httptools

if TYPE_CHECKING:
    from .front import Connection

REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
ASGI = {"version": "3.0", "spec_version": "2.3"}
RELAY = "slofleet.relay"  # the scope's extension holding the Exchange, for the Router to relay a stream into


class Exchange:
    """One request and its answer: what the app reads (scope, receive) and writes (send, write)."""

    def __init__(self, conn: Connection, method: str, raw_path: bytes, headers: list, *, keep_alive: bool,
                 expect_continue: bool, droppable: bool, http10: bool):
        self.conn, self.method, self.keep_alive = conn, method, keep_alive
        self.droppable = droppable  # if answered before its body is read, the rest may be read and dropped (front.py)
        self.http10 = http10  # an HTTP/1.0 request: a streamed answer goes without chunks
        url = httptools.parse_url(raw_path)
        path = url.path.decode("latin-1")
        self.scope = {"type": "http", "asgi": ASGI, "http_version": "1.1",
                      "method": method, "scheme": "http", "path": urllib.parse.unquote(path) if "%" in path else path,
                      "raw_path": url.path, "query_string": url.query or b"", "root_path": "", "headers": headers,
                      "client": conn.peer, "server": conn.local, "extensions": {RELAY: self}}
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered, self.complete, self.delivered, self.expect_continue = 0, False, False, expect_continue
        self.head: list[bytes] | None = None  # the answer's status line and headers until written
        self.has_length = self.started = self.chunked = self.finished = False
        self.streaming = False  # the head is out and the body goes in chunks: write's short way
        self.dropping = False  # answered early: the rest of its body is being dropped
        self.waiter: asyncio.Future | None = None
        self.source = None  # the replica connection relaying into this answer (paused while the client is)
        self.on_disconnect = None  # called if the client leaves (at most once), as ASGI's receive would tell

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    @property
    def gone(self) -> bool:
        """The client has left."""
        return self.conn.closed

    @property
    def slow(self) -> bool:
        """The client is behind: its connection's write buffer is over the high-water mark."""
        return self.conn.write_paused

    async def receive(self) -> dict:
        conn = self.conn
        while True:
            if self.body or (self.complete and not self.delivered):
                data = self.body.popleft() if len(self.body) == 1 else b"".join(self.body)
                self.body.clear()
                self.buffered, self.delivered = 0, self.complete
                conn.resume_body()
                return {"type": "http.request", "body": data, "more_body": not self.complete}
            if conn.closed or self.finished:
                return {"type": "http.disconnect"}
            if self.expect_continue and not self.started:
                self.expect_continue = False
                conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiter = conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            status = message["status"]
            self.head = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b""))]
            for k, v in message.get("headers", ()):
                self.head.append(b"%s: %s\r\n" % (k, v))
                self.has_length = self.has_length or k.lower() == b"content-length"
            return
        more = message.get("more_body", False)
        self.write(message.get("body", b""), more)
        if more and self.conn.write_paused:
            await self.conn.drain()

    def write(self, body: bytes, more: bool) -> None:
        """Body bytes of the answer, framed (chunked unless the length was given or is known now); the last ones
        (`more` false) end it."""
        if self.streaming and more and body and not self.conn.closed:  # a relayed stream's every read
            self.conn.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
            return
        if self.finished or self.conn.closed:
            return
        out = b""
        if not self.started:
            head, self.started = self.head, True
            if not self.complete and not self.droppable:  # too much unread body to drop: the connection closes
                self.keep_alive = False
            if not self.has_length and more and self.http10:  # no chunks in HTTP/1.0: the body ends with the close
                self.keep_alive = False
            elif not self.has_length:
                self.chunked = more
                head.append(b"transfer-encoding: chunked\r\n" if more else b"content-length: %d\r\n" % len(body))
            if not self.keep_alive:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            out = b"".join(head)
        if self.method == "HEAD":
            body = b""
        if self.chunked:
            out += (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n")
        else:
            out += body
        self.conn.transport.write(out)
        self.streaming = self.chunked and more and self.method != "HEAD"
        if not more:
            self.finish()

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.wake()
            self.conn.answered(self)
