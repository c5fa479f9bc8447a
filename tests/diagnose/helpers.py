"""`slofleet diagnose --json` as a subprocess, the loads that inject each fault, and a slow relay to put between a
router and an engine."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from slofleet.api.contract import BUCKET_HEADER
from tests.support import ROOT
from tests.support.server import serve_in_thread

MODEL = "SmolLM2-135M-Instruct"
HEALTHY = {"name": "chat", "slo": {"percentile": 90, "ttftMs": 60000, "tpotMs": 10000, "e2eMs": 120000}}


def diagnose(folder: Path, buckets: list[dict], *urls: str, window: float | None = None) -> dict:
    """Run `slofleet diagnose --json` on a file holding only spec.buckets; stdout must be one JSON object."""
    path = folder / "buckets.yaml"
    path.write_text(yaml.safe_dump({"spec": {"buckets": buckets}}))
    cmd = [sys.executable, "-m", "slofleet.cli", "diagnose", "--buckets", str(path), "--json",
           *(f for u in urls for f in ("--url", u)), *(("--window", str(window)) if window else ())]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 60
    return json.loads(out.stdout)  # raises on anything besides one JSON object


def send(url: str, bucket: str, prompts: list[str], max_tokens: int, concurrent: bool = True, stream: bool = False,
         **extra) -> list[int]:
    """POST one completion per prompt in `bucket` (all at once, or one after the other); their status codes."""
    async def go() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(prompt: str) -> int:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "stream": stream, **extra}
                async with client.stream("POST", url + "/v1/completions", json=body,
                                         headers={BUCKET_HEADER: bucket}) as r:
                    await r.aread()
                    return r.status_code

            if concurrent:
                return list(await asyncio.gather(*map(one, prompts)))
            return [await one(p) for p in prompts]

    return asyncio.run(go())


class SlowRelay:
    """A hop between router and engine that is slow (a proxy, a sidecar, a long network path): it passes every
    request through and holds each generation answer `delay` seconds before its first byte."""

    def __init__(self, upstream: str, delay: float):
        self.upstream, self.delay = upstream, delay
        self.client: httpx.AsyncClient | None = None  # opened in the server's own event loop
        self.server, self.thread, self.url = serve_in_thread(self.app)

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.client = self.client or httpx.AsyncClient(timeout=300)
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"host", b"content-length")]
        req = self.client.build_request(scope["method"], self.upstream + scope["path"], content=body, headers=headers)
        r = await self.client.send(req, stream=True)
        try:
            if scope["method"] == "POST":
                await asyncio.sleep(self.delay)
            await send({"type": "http.response.start", "status": r.status_code,
                        "headers": [(b"content-type", r.headers.get("content-type", "text/plain").encode())]})
            async for chunk in r.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await r.aclose()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
