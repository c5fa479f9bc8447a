"""GET /debug/traces and /debug/traces/{request or trace id} on the router, under its API keys like /v1/models
(traces show request metadata, though never prompt text).

A request's engine spans are kept by the engines that served it: the router fetches them (with the internal token)
from the replicas its own spans name and merges them in, so one call shows the router's, the prefill engine's and the
decode engine's spans under one trace id."""
from __future__ import annotations

import asyncio
import json

import aiohttp

from slofleet.tracing.core import merge, peers

from .gateway import GatewayError
from .wire import error_body, headers_of, respond

PEER_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


async def peer_spans(session: aiohttp.ClientSession, url: str, trace_id: str) -> list[dict]:
    try:
        async with session.get(f"{url}/debug/traces/{trace_id}", timeout=PEER_TIMEOUT) as r:
            return (await r.json())["spans"] if r.status == 200 else []
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError):
        return []  # a replica gone since, or keeping the trace no longer: the rest still shows


async def debug_traces(router, scope, send) -> None:
    try:
        router.keys.authenticate(headers_of(scope))
    except GatewayError as e:
        return await respond(send, e.status, error_body(e.status, e.message, e.kind))
    key = scope["path"].removeprefix("/debug/traces").strip("/")
    if not key:
        return await respond(send, 200, json.dumps({"traces": router.tracing.recent.summaries()}).encode())
    found = router.tracing.recent.get(key)
    if found is None:
        return await respond(send, 404, error_body(404, f"no trace kept for {key!r}", "not_found_error"))
    tid = found["trace_id"]
    parts = await asyncio.gather(*(peer_spans(router.session, url, tid) for url in sorted(peers(found["spans"]))))
    await respond(send, 200, json.dumps(merge(tid, None if key == tid else key, [found["spans"], *parts])).encode())
