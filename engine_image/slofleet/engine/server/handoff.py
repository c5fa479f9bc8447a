"""Decode role: pull a prompt's KV from the prefill engine the router named (the KV hand-off over HTTP)."""
from __future__ import annotations

import dataclasses

import httpx

from ..errors import UpstreamError
from ..kv_transfer import KVPayload
from ..sampling_params import SamplingParams
from .http import ApiError


def peer_message(r: httpx.Response) -> str:
    """What a peer engine said, from its OpenAI-shaped error only: never echo a body we did not expect."""
    try:
        return str(r.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}"


async def fetch_kv(url: str, ids: list[int], params: SamplingParams) -> KVPayload:
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            r = await client.post(url.rstrip("/") + "/v1/kv/prefill",
                                  json={"prompt_token_ids": ids, "sampling": dataclasses.asdict(params)})
    except httpx.HTTPError as e:
        raise UpstreamError(f"prefill engine {url} unreachable: {type(e).__name__}") from None
    if r.status_code != 200:
        if r.status_code < 500:  # the prefill engine refused the request itself (e.g. 429): pass it on
            raise ApiError(r.status_code, f"prefill engine: {peer_message(r)}", "upstream_error",
                           headers={k: v for k, v in r.headers.items() if k.lower() == "retry-after"} or None)
        raise UpstreamError(f"prefill engine {url}: {peer_message(r)}")
    return KVPayload.from_bytes(r.content)
