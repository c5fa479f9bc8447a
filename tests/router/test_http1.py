"""The router's HTTP/1.1 client (slofleet.router.http1) against a raw asyncio server: kept-alive connections are
reused, one the server closed while idle is replaced without an error, an answer without length ends with the
connection while a chunked one cut short fails, a silent answer ends with TimeoutError, and a reader that falls
behind pauses reading from the server instead of buffering without bound."""
from __future__ import annotations

import asyncio

import pytest

from slofleet.router import http1

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve(handler) -> tuple[asyncio.Server, str]:
    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await handler(await reader.readexactly(length), writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def test_connections_are_kept_alive_and_one_closed_while_idle_is_replaced():
    async def main() -> None:
        writers = []

        async def answer(body: bytes, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            writer.write(HEAD + chunk(b"data: " + body + b"\n\n") + b"0\r\n\r\n")

        server, url = await serve(answer)
        pool = http1.Pool(2.0, {"authorization": "Bearer t"})
        for i in range(3):
            resp = await pool.post(url, "/v1/completions", b"%d" % i, {"x-request-id": str(i)})
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            assert await resp.read() == b"data: %d\n\n" % i
            resp.release()
        assert len({id(w) for w in writers}) == 1, "one connection for requests one after another"
        writers[-1].close()  # the server's keep-alive timeout
        await asyncio.sleep(0.1)
        resp = await pool.post(url, "/v1/completions", b"again", {})
        assert await resp.read() == b"data: again\n\n"
        resp.release()
        pool.close()
        await asyncio.sleep(0.05)  # the server's handlers see the connections close
        server.close()

    run(main())


def test_an_answer_without_length_ends_with_the_connection_and_one_cut_short_fails():
    async def main() -> None:
        async def answer(body: bytes, writer: asyncio.StreamWriter) -> None:
            if body == b"eof":  # neither content-length nor chunks: the body is what comes before the close
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"ok\": true}")
            else:  # a chunked answer that stops without its last chunk
                writer.write(HEAD + chunk(b"data: partial\n\n"))
            await writer.drain()
            writer.close()

        server, url = await serve(answer)
        pool = http1.Pool(2.0, {})
        resp = await pool.post(url, "/v1/completions", b"eof", {})
        assert await resp.read() == b'{"ok": true}'
        resp.release()
        resp = await pool.post(url, "/v1/completions", b"cut", {})
        assert await resp.readany() == b"data: partial\n\n"
        with pytest.raises(OSError):
            await resp.readany()
        resp.close()
        await asyncio.sleep(0.05)
        server.close()

    run(main())


def test_a_silent_answer_times_out_and_a_refused_connect_is_an_oserror():
    async def main() -> None:
        async def stall(body: bytes, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + chunk(b"data: first\n\n"))

        server, url = await serve(stall)
        pool = http1.Pool(2.0, {})
        resp = await pool.post(url, "/v1/completions", b"{}", {})
        assert await resp.readany() == b"data: first\n\n"
        resp.watch(0.2)
        with pytest.raises(asyncio.TimeoutError):
            await resp.readany()
        resp.close()
        server.close()
        await server.wait_closed()
        with pytest.raises(OSError):
            await pool.post(url, "/v1/completions", b"{}", {})

    run(main())


def test_a_reader_behind_the_server_pauses_reading(monkeypatch):
    monkeypatch.setattr(http1, "HIGH_WATER", 1 << 12)

    async def main() -> None:
        sent = asyncio.Event()

        async def flood(body: bytes, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD)
            for _ in range(64):
                writer.write(chunk(b"x" * 1024))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            sent.set()

        server, url = await serve(flood)
        pool = http1.Pool(2.0, {})
        resp = await pool.post(url, "/v1/completions", b"{}", {})
        await asyncio.sleep(0.3)  # not reading: the server fills the socket buffers while ours stays bounded
        assert resp.conn.paused and resp.conn.buffered < 48 * 1024, "the high-water mark and a read, of 64 KiB sent"
        assert len(await resp.read()) == 64 * 1024
        await asyncio.wait_for(sent.wait(), 5)
        resp.release()
        pool.close()
        await asyncio.sleep(0.05)  # the server's handlers see the connections close
        server.close()

    run(main())
