"""A stream that fails after its headers ends with one SSE event carrying the same OpenAI error body every HTTP
component answers with (contract.error_body), so clients parse engine and router errors alike."""
from __future__ import annotations

import asyncio
import json

from slofleet.api.contract import error_body
from slofleet.engine.server.openai_format import sse_stream


async def failing():
    raise RuntimeError("the engine loop died")
    yield  # an async generator that fails on its first step


def test_a_stream_that_fails_ends_with_the_shared_error_body():
    async def collect() -> list[str]:
        return [chunk async for chunk in sse_stream(failing(), {"id": "x"}, lambda outs: {}, None, False)]

    chunks = asyncio.run(collect())
    assert len(chunks) == 1 and chunks[0].startswith("data: ") and chunks[0].endswith("\n\n")
    assert json.loads(chunks[0][len("data: "):]) == error_body("the engine loop died", "server_error", code=500)
