"""The engine's outer middleware: the API key on /v1/* and /debug/*, and the last line of defence that turns an
unexpected error into this request's 500 only."""
from __future__ import annotations

import hmac
import logging

from starlette.requests import Request

from .http import ApiError
from .lifecycle import GENERATION
from .settings import ServerSettings

log = logging.getLogger("slofleet.engine.api")
# What a gateway's traffic may reach without the internal token, under --no-require-internal-token.
GATEWAY_PATHS = frozenset({*GENERATION, "/v1/embeddings", "/v1/models"})


def bearer_is(request: Request, key: str) -> bool:
    given = request.headers.get("authorization", "")
    return bool(key) and hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


class Guard:
    """The API key (on /v1/* and /debug/*), and the last line of defence: an unexpected error fails this request
    only, with its request id (Traced's), which the log line carries too. Plain ASGI, so handlers still see the
    client's disconnect."""

    def __init__(self, app, settings: ServerSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope["state"]
        rid = state["request_id"]  # Traced's, outside this one
        keys, request = [self.settings.api_key, self.settings.internal_token], Request(scope)
        state["internal"] = bearer_is(request, self.settings.internal_token)
        gateway = not self.settings.require_internal_token and scope["path"] in GATEWAY_PATHS
        needed = self.settings.api_key if gateway else any(keys)
        if needed and scope["path"].startswith(("/v1/", "/debug/")) and not any(bearer_is(request, k) for k in keys):
            err = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error")
            return await err.response()(scope, receive, send)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            log.exception("request %s failed", rid)
            if started:
                raise
            err = ApiError(500, f"internal error while serving this request (request id {rid})", "server_error")
            await err.response()(scope, receive, send)
