"""Whose fault it is: each error the engine raises says so, and the server maps the class to a status.

Only `InvalidRequest` means the client sent something wrong (400); a built-in `ValueError` escaping from
inside the engine is a bug of ours and answers 500, never blamed on the client."""
from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's own errors."""


class InvalidRequest(EngineError, ValueError):
    """The request cannot be served as sent (400); the message says what to change. A ValueError too, so
    offline callers that caught ValueError still do."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class AdmissionError(EngineError):
    """The engine is full (429 with Retry-After): the request may succeed later or elsewhere."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class UpstreamError(EngineError):
    """A peer (a prefill engine, a KV transport) failed or answered something unusable (502)."""


class PoolExhausted(EngineError):
    """More KV blocks were asked of the pool than it has free: a scheduler bug, never the client's."""
