"""The engine's part of a request's trace, and the x-request-id on every response.

A generation request's SERVER span continues the caller's traceparent (the router's, or a client's). Its children
come from the request's lifecycle events when the response ends (the engine core records them and knows nothing of
tracing): parse (body, validation, tokenization), queue, prefill with a span per chunk (kv_import on a decode
engine that received the prompt's KV), decode with its step count (kv_export on a prefill engine), and stream (first
token to last byte: the SSE deltas, each token's text detokenized in the engine step that sampled it, and the
client's reading). The KV hand-off is a live CLIENT span whose traceparent the prefill peer continues; its
duration goes back to the router as `server-timing: kv_handoff;dur=MS`."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from slofleet.api.contract import REQUEST_ID_HEADER, SERVER_TIMING_HEADER, error_body
from slofleet.tracing.core import CLIENT, LeanSpan, RequestTrace, Tracing, request_id_of, with_request_id

from ..request import Event, Request

TRACED = ("/v1/completions", "/v1/chat/completions", "/v1/kv/prefill")


def headers_of(scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


class Traced:
    """Outermost ASGI middleware: the request id (a caller's well-formed x-request-id, else a new one) in
    scope state for the handlers and on the response; a trace for each generation request. What the handlers leave in
    the state: `engine_request` (the engine's Request), `handoff` (the KV fetch's span, ended)."""

    def __init__(self, app, tracing: Tracing):
        self.app, self.tracing = app, tracing

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        rid = state["request_id"] = request_id_of(scope)
        send = with_request_id(send, rid)
        if scope["path"] not in TRACED:
            return await self.app(scope, receive, send)
        rt = state["trace"] = self.tracing.begin(scope["method"], scope["path"], headers_of(scope), rid)
        status = None

        async def sender(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                handoff = state.get("handoff")
                if handoff is not None:  # known before the head: the hand-off precedes the first token
                    ms = (handoff.end_time - handoff.start_time) / 1e6
                    timing = (SERVER_TIMING_HEADER.encode(), f"kv_handoff;dur={ms:.2f}".encode())
                    message = {**message, "headers": [*message.get("headers", ()), timing]}
            await send(message)

        try:
            await self.app(scope, receive, sender)
        finally:
            req = state.get("engine_request")
            end = time.time_ns()
            if req is not None:
                lifecycle_spans(rt, req, end, state.get("handoff"))
            rt.end(status, end, **({} if req is None else summary(req)))


@contextlib.contextmanager
def handoff_span(state, peer: str) -> Iterator[dict[str, str]]:
    """The KV fetch from the prefill peer as a CLIENT span; yields the headers that carry the trace and the request
    id to the peer."""
    rt: RequestTrace = state.trace
    span = rt.span("kv_handoff", kind=CLIENT, prefill_replica=peer)
    try:
        yield {**rt.headers(span), REQUEST_ID_HEADER: state.request_id}
    finally:
        span.end()
        state.handoff = span


def add_debug_routes(app: FastAPI, tracing: Tracing) -> None:
    """GET /debug/traces (the kept traces, newest first) and /debug/traces/{request or trace id} (its spans here);
    under the API key like /v1/*, since they show request metadata."""

    async def traces() -> dict:
        return {"traces": tracing.recent.summaries()}

    async def trace_of(key: str) -> JSONResponse:
        found = tracing.recent.get(key)
        if found is None:
            return JSONResponse(error_body(f"no trace kept for {key!r}", "not_found_error", code=404), 404)
        return JSONResponse(found)

    app.add_api_route("/debug/traces", traces, methods=["GET"])
    app.add_api_route("/debug/traces/{key}", trace_of, methods=["GET"])


def summary(req: Request) -> dict:
    return {"bucket": req.bucket, "priority": req.priority, "prompt_tokens": req.num_prompt_tokens,
            "cached_tokens": req.num_cached_tokens, "output_tokens": len(req.output_token_ids),
            "preemptions": req.count(Event.PREEMPTED),
            "finish_reason": None if req.finish_reason is None else str(req.finish_reason)}


def lifecycle_spans(rt: RequestTrace, req: Request, end_ns: int, handoff: LeanSpan | None) -> None:
    """The request's phases from its lifecycle events (monotonic seconds, placed on the wall clock here)."""
    events = list(req.events)  # the engine thread may still append (an abort being processed)
    offset = time.time_ns() - int(time.monotonic() * 1e9)

    def ns(t: float) -> int:
        return int(t * 1e9) + offset

    def first(kind: Event) -> int | None:
        return next((ns(t) for e, t in events if e is kind), None)

    arrived, scheduled, first_token, done = (first(e) for e in (Event.ARRIVED, Event.SCHEDULED, Event.FIRST_TOKEN,
                                                                  Event.FINISHED))
    stop = min(done or end_ns, end_ns)
    rt.span("parse", rt.start_ns, arrived if handoff is None else handoff.start_time)
    rt.span("queue", arrived, scheduled or stop, priority=req.priority)
    for e, t in events:
        if e is Event.PREEMPTED:
            rt.root.add_event("preempted", timestamp=ns(t))
    if scheduled is None:
        return
    chunks = [(e, ns(t)) for e, t in events if e in (Event.SCHEDULED, Event.PREFILL_CHUNK)]
    n_chunks = sum(1 for e, _ in chunks if e is Event.PREFILL_CHUNK)
    prefill = rt.span("prefill" if handoff is None else "kv_import", scheduled, prompt_tokens=req.num_prompt_tokens,
                      cached_tokens=req.num_cached_tokens, computed_tokens=req.num_prompt_computed, chunks=n_chunks)
    i, start = 0, scheduled
    for e, t in chunks:  # a chunk runs from its step's schedule (or the previous chunk's end) to its forward's end
        if e is Event.PREFILL_CHUNK:
            rt.span("prefill_chunk", start, t, parent=prefill, index=i)
            i += 1
        start = t
    prefill.end(end_time=first_token or stop)
    if first_token is None:
        return
    n_out = len(req.output_token_ids)
    rt.span("kv_export" if req.export_kv else "decode", first_token, stop, output_tokens=n_out,
            steps=max(0, n_out - 1), finish_reason=None if req.finish_reason is None else str(req.finish_reason))
    rt.span("kv_send" if req.export_kv else "stream", first_token if not req.export_kv else stop, end_ns)
