"""What an engine serves by its role, draining before removal, and the end of the shutdown's grace period.

- Role: a prefill engine only prefills for decode engines (/v1/kv/prefill), so it refuses generation requests; a
  decode engine refuses /v1/kv/prefill; a unified engine serves both.
- Drain (POST /v1/drain, DELETE to resume; the internal token's holders only): the operator drains an engine pod
  before it scales the pod away, so /ready turns 503 (routers and the Service stop sending it work) and new
  requests get 503 while in-flight ones run to their end, however long; then it removes the pod.
- Deadline: SIGTERM gives in-flight requests the grace period; just before it ends, every request still open
  is answered with an error (an SSE error event on a stream), instead of a connection cut without a word.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from slofleet.api.contract import DECODE, PREFILL

from .http import ApiError

log = logging.getLogger("slofleet.engine.lifecycle")
GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
PREFILL_PATH = "/v1/kv/prefill"
CUT_MESSAGE = "the server shut down before this request finished (its grace period ended); retry the request"


def served(role: str, path: str) -> bool:
    return not ((role == PREFILL and path in GENERATION) or (role == DECODE and path == PREFILL_PATH))


def for_role(role: str, path: str, handler: Callable) -> Callable:
    """`handler`, or (where this role does not serve `path`) one that says which engines do."""
    if served(role, path):
        return handler
    where = "decode or unified engines (through the router)" if path in GENERATION else "prefill or unified engines"

    async def refuse(request: Request):
        raise ApiError(404, f"this engine's role is {role}: it does not serve {path}; send it to {where}",
                       "not_found_error")

    return refuse


async def drain(request: Request) -> JSONResponse:
    state = request.app.state.slofleet
    if state.settings.internal_token and not request.state.internal:
        raise ApiError(403, "draining is for the service's internal token (the operator's)", "permission_error")
    state.draining = request.method == "POST"
    running = len(state.async_engine.queues) if state.async_engine else 0
    log.info("%s by request: %d requests in flight", "draining" if state.draining else "resumed", running)
    return JSONResponse({"draining": state.draining, "in_flight": running})


def cut_open_requests(state) -> None:
    """Answer every open request with an error now (from the event loop's thread): each consumer raises it,
    a stream as its last SSE event, and aborts its request in the engine."""
    ae = state.async_engine
    if ae is None:
        return
    if ae.queues:
        log.warning("grace period over: cutting %d open requests", len(ae.queues))
    for queue in list(ae.queues.values()):
        queue.put_nowait(ApiError(503, CUT_MESSAGE, "unavailable"))
