"""The router's own HTTP/1.1 server (front.py) in-process, with the real Router behind it and a stand-in upstream:
what uvicorn did for it (pipelining, 100-continue, keep-alive and close, malformed heads) and what it adds (a
streamed answer relayed from the replica connection's callbacks, leaving no reference cycles behind)."""
from __future__ import annotations

import asyncio
import gc
import json

import aiohttp

from slofleet.api.contract import UNIFIED
from slofleet.router.balancer import Balancer
from slofleet.router.buckets import DEFAULT_BUCKETS, Classifier
from slofleet.router.front import Front
from slofleet.router.gateway import KeyStore, Quotas
from slofleet.router.proxy import Router, RouterConfig
from slofleet.router.replicas import ReplicaSet
from tests.router.helpers import StandIn


async def serving(upstream: str, body):
    """Run `body(port)` against a router on a free port (its replica `upstream`), then stop it."""
    router = Router(RouterConfig(), ReplicaSet(static={upstream: UNIFIED}, interval=0.1),
                    Classifier(DEFAULT_BUCKETS), KeyStore(None, None), Quotas(), Balancer("prefix", 1.25))
    await router.start()
    front = Front(router, head_timeout=5.0, max_head_bytes=1 << 16, keep_alive=5.0)
    server = await asyncio.get_running_loop().create_server(front.protocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        while not router.replicas.ready():
            await asyncio.sleep(0.05)
        return await body(port)
    finally:
        server.close()
        for c in list(front.connections):
            c.transport.close()
        await router.stop()


async def exchange(port: int, data: bytes, until: bytes, then: bytes = b"") -> bytes:
    """Send raw bytes, read until `until` has arrived (then send `then` and read to the end)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    got = b""
    while until not in got and (chunk := await asyncio.wait_for(reader.read(65536), 5)):
        got += chunk
    if then:
        writer.write(then)
        got += await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return got


def test_streams_are_relayed_whole_and_leave_no_cycles():
    upstream = StandIn()

    async def body(port: int) -> list[str]:
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> str:
                async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                                  json={"model": "m", "prompt": f"hi {i}", "max_tokens": 4, "stream": True}) as r:
                    assert r.status == 200 and r.headers["transfer-encoding"] == "chunked"
                    return (await r.read()).decode()

            await asyncio.gather(*(one(i) for i in range(5)))  # connections, pools, first spans made
            gc.collect()
            gc.disable()
            try:
                answers = await asyncio.gather(*(one(i) for i in range(20)))
                gc.set_debug(gc.DEBUG_SAVEALL)
                gc.collect()
                ours = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("slofleet.")]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
            assert ours == [], f"reference cycles left by requests: {sorted(set(ours))}"
            return answers

    try:
        answers = asyncio.run(serving(upstream.url, body))
    finally:
        upstream.stop()
    for text in answers:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[0])["priority"] is not None


def test_pipelined_requests_continue_close_and_early_answers():
    upstream = StandIn()

    async def body(port: int) -> tuple[bytes, ...]:
        pipelined = await exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /nowhere HTTP/1.1\r\nHost: x\r\n"
                                         b"\r\n", until=b"no route")
        request = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue"
                b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(request))
        continued = await exchange(port, head, until=b"100 Continue\r\n\r\n", then=request)
        malformed = await exchange(port, b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", until=b"\r\n\r\n")
        # answered (404) before its body came: the rest is dropped and the connection goes on to the next request
        early = await exchange(port, b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345",
                               until=b"no route",
                               then=b"67890GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        big = b"x" * 200_000  # read in full (reading pauses past 64 KiB) and never asked for: reading must go on
        unread = await exchange(port, b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                                % (len(big), big), until=b"no route",
                                then=b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        stream = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # HTTP/1.0 has no chunks: read to the close
        writer.write(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(stream), stream))
        old = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return pipelined, continued, malformed, early + unread, old

    try:
        pipelined, continued, malformed, early, old = asyncio.run(serving(upstream.url, body))
    finally:
        upstream.stop()
    first, second = pipelined.split(b"HTTP/1.1 ")[1:]  # both answered, in order, on one connection
    assert first.startswith(b"200 OK") and first.endswith(b"\r\n\r\nok")
    assert second.startswith(b"404 Not Found") and b"no route GET /nowhere" in second
    assert continued.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
    assert b"connection: close\r\n" in continued and continued.endswith(b"0\r\n\r\n")  # read to the close
    assert malformed.startswith(b"HTTP/1.1 400 Bad Request") and b"malformed request" in malformed
    assert early.startswith(b"HTTP/1.1 404 Not Found") and b"connection: close" not in early.split(b"HTTP/1.1 200")[0]
    assert early.count(b"HTTP/1.1 404 Not Found") == 2 and early.count(b"HTTP/1.1 200 OK\r\n") == 2
    head, _, rest = old.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"chunked" not in head and b"connection: close" in head
    assert rest.startswith(b"data: {") and rest.endswith(b"data: [DONE]\n\n")
