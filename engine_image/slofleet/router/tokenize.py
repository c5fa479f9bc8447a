"""vLLM's /tokenize and /detokenize through the router (its bench client counts prompt tokens with them): a ready
replica's answer as it gave it, since every replica serves the same model and tokenizer."""
from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp

from .gateway import GatewayError
from .upstream import RETRYABLE, SERVING
from .wire import error_body, respond

if TYPE_CHECKING:
    from .proxy import Router

TOKENIZE = frozenset({"/tokenize", "/detokenize"})


async def tokenize(router: Router, scope, receive, send, headers: dict[str, str]) -> None:
    try:
        router.keys.authenticate(headers)
        body = await router.read_body(receive, headers)
    except GatewayError as e:
        return await respond(send, e.status, error_body(e.status, e.message, e.kind))
    for r in router.replicas.ready(SERVING):
        try:
            async with router.session.post(r.url + scope["path"], data=body,
                                           headers={"content-type": "application/json"},
                                           timeout=aiohttp.ClientTimeout(total=router.cfg.idle_timeout)) as resp:
                return await respond(send, resp.status, await resp.read())
        except RETRYABLE as e:
            router.replicas.mark_failed(r, str(e))
    await respond(send, 503, error_body(503, "no ready replica", "unavailable"))
