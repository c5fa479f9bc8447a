"""An in-process stand-in upstream for the router tests."""
from __future__ import annotations

import asyncio
import json

from tests.support.server import serve_in_thread


class Answer:
    """An upstream answer as Upstream's opener returns it, for the tests that drive Upstream's tries in-process."""

    def __init__(self, status: int, body: bytes):
        self.status, self.body, self.closed = status, body, False

    async def read(self) -> bytes:
        return self.body

    async def readany(self) -> bytes:
        return self.body

    def close(self) -> None:
        self.closed = True

    def header(self, name: bytes) -> str | None:
        return None


class StandIn:
    """A stand-in engine (not the real one): answers /ready, /metrics and /v1/models (with `max_model_len` when
    set), and streams one SSE event echoing what it received (priority, bucket header) after `delay` seconds, then
    [DONE] after `stall` more seconds (or the request's own "stall"; with `cut`, it drops the connection instead).
    Records aborted streams."""

    def __init__(self, delay: float = 0.0, port: int | None = None):
        self.delay, self.status, self.crash = delay, 200, False
        self.stall, self.cut, self.max_model_len = 0.0, False, None
        self.probe_delay = 0.0  # seconds /ready takes to answer: a busy engine
        self.received: list[dict] = []
        self.aborted = 0
        self.port = port  # set before it serves: a router already waiting for this port reaches it at once
        self.server, self.thread, self.url = serve_in_thread(self.app, port)
        self.port = int(self.url.rsplit(":", 1)[1])

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/v1/models":
            models = {"data": [{"id": "m", "object": "model", "max_model_len": self.max_model_len}]}
            await send({"type": "http.response.start", "status": 200 if self.max_model_len else 404, "headers": []})
            return await send({"type": "http.response.body", "body": json.dumps(models).encode()})
        if path.startswith("/debug/"):  # it keeps no traces
            await send({"type": "http.response.start", "status": 404, "headers": []})
            return await send({"type": "http.response.body", "body": b"{}"})
        if path in ("/ready", "/health", "/metrics"):
            if path == "/ready" and self.probe_delay:
                await asyncio.sleep(self.probe_delay)
            body = b"vllm:num_requests_waiting 0.0\n" if path == "/metrics" else b"ok"
            await send({"type": "http.response.start", "status": 200, "headers": []})
            return await send({"type": "http.response.body", "body": body})
        raw, more = b"", True
        while more:
            msg = await receive()
            raw, more = raw + msg.get("body", b""), msg.get("more_body", False)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        request = json.loads(raw)
        seen = {"priority": request.get("priority"), "bucket": headers.get("x-slofleet-bucket"),
                "authorization": headers.get("authorization"), "port": self.port,
                "traceparent": headers.get("traceparent"), "request_id": headers.get("x-request-id"),
                "tpot": headers.get("x-slofleet-tpot-ms")}
        self.received.append(seen)
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if self.crash:  # a replica dying mid-prefill: headers sent, then the connection drops
            raise RuntimeError("stand-in crashed on purpose")
        if self.delay:  # like the engine: a client that leaves while we wait aborts the request
            gone = asyncio.ensure_future(receive())
            done, _ = await asyncio.wait({gone}, timeout=self.delay)
            if done and gone.result()["type"] == "http.disconnect":
                self.aborted += 1
                return
            gone.cancel()
        await send({"type": "http.response.body", "body": f"data: {json.dumps(seen)}\n\n".encode(),
                    "more_body": True})
        if self.cut:  # a replica dying mid-stream
            raise RuntimeError("stand-in cut its stream on purpose")
        await asyncio.sleep(request.get("stall", self.stall))  # a request may ask for its own (the body passes through)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
