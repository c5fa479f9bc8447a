"""HTTP edges of the engine server: the OpenAI-shaped error, engine errors mapped to statuses, body parsing."""
from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from slofleet.api.base import error_text
from slofleet.api.contract import error_body

from ..errors import AdmissionError, InvalidRequest, UpstreamError


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        # A lone surrogate (from a client's text or a peer's message) cannot be encoded as JSON: show it escaped.
        message = message.encode("utf-8", "backslashreplace").decode()
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.status), status_code=self.status,
                            headers=self.headers)


def from_engine(e: InvalidRequest | AdmissionError | UpstreamError) -> ApiError:
    """The status an engine error stands for: whose fault it is decides it."""
    if isinstance(e, AdmissionError):
        return ApiError(429, str(e), "rate_limit_exceeded", headers={"Retry-After": str(max(1, int(e.retry_after)))})
    if isinstance(e, UpstreamError):
        return ApiError(502, str(e), "upstream_error")
    return ApiError(400, str(e), param=e.param)


def unavailable(message: str, retry_after: int | None = None) -> ApiError:
    return ApiError(503, message, "unavailable", headers={"Retry-After": str(retry_after)} if retry_after else None)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` and with 408 if it trickles in."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, f"the request body is larger than {limit} bytes: send a shorter prompt")

    async def collect() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes: send a shorter prompt")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s") from None


def parse(raw: bytes, model: type[BaseModel]) -> Any:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError:  # json's guard against integer literals over sys.get_int_max_str_digits() digits
        raise ApiError(400, "the request body holds a number with too many digits") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, error_text(e)) from None


def seconds_of_ms(value: str | None) -> float | None:
    """A header's milliseconds in seconds; None unless a positive finite number (a bad hint is ignored, not fatal)."""
    try:
        ms = float(value or "")
    except ValueError:
        return None
    return ms / 1000 if 0 < ms < math.inf else None
