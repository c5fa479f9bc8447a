"""FastAPI app: OpenAI-compatible endpoints, health/readiness, metrics.

/health answers as soon as the process is up; the model loads and warms in a background thread and
/ready turns 200 only then. On SIGTERM /ready turns 503 and new requests are refused while in-flight
ones finish (the server's graceful-shutdown timeout bounds the wait)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from ..config import EngineConfig
from ..engine import LLMEngine, RequestOutput
from ..kv_transfer import KVPayload
from ..sampling_params import SamplingParams
from ..scheduler import AdmissionError
from .async_engine import AsyncEngine
from .metrics import Metrics
from .openai_format import chat_handlers, completion_handlers
from .protocol import ChatCompletionRequest, CompletionRequest, PrefillRequest, SamplingFields

log = logging.getLogger("slofleet.engine.api")
BUCKET_HEADER = "x-slofleet-bucket"
PREFILL_HEADER = "x-slofleet-prefill-url"  # set by the router: pull this prompt's KV from that prefill engine


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class State:
    """What the handlers share: the engine once loaded, and the lifecycle flags."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine: LLMEngine | None = None
        self.async_engine: AsyncEngine | None = None
        self.metrics: Metrics | None = None
        self.ready = False
        self.draining = False
        self.load_error: BaseException | None = None

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            engine = LLMEngine(self.config)
            warm = engine.add_request([engine.tokenizer.eos_token_id or 0], SamplingParams(max_tokens=2, ignore_eos=True))
            while not warm.finished:
                engine.step()
            self.engine, self.metrics = engine, Metrics(engine)
            self.async_engine = AsyncEngine(engine, self.metrics.observe)
            self.async_engine.start(loop)
            self.ready = True
            log.info("ready: serving %s", engine.model_name)
        except BaseException as e:
            log.exception("model load failed")
            self.load_error = e


def error_text(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        msg = "unknown field: remove it or check its spelling" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


async def parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}")
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, error_text(e))


def build_app(config: EngineConfig) -> FastAPI:
    state = State(config)
    app = FastAPI(title="slofleet engine")
    app.state.slofleet = state

    @app.on_event("startup")
    async def _start() -> None:
        threading.Thread(target=state.load, args=(asyncio.get_running_loop(),), name="model-load",
                         daemon=True).start()

    @app.on_event("shutdown")
    async def _stop() -> None:
        if state.async_engine is not None:
            state.async_engine.stop()

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.get("/health")
    async def health() -> Response:
        failed = state.load_error or (state.async_engine and state.async_engine.error)
        if failed:
            return PlainTextResponse(f"engine failed: {failed}", status_code=500)
        return PlainTextResponse("ok")

    @app.get("/ready")
    async def ready() -> Response:
        if state.ready and not state.draining:
            return PlainTextResponse("ready")
        return PlainTextResponse("draining" if state.draining else "loading", status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        engine = require_engine()
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "slofleet", "max_model_len": engine.max_model_len}]}

    def require_engine() -> LLMEngine:
        if state.draining:
            raise ApiError(503, "the server is shutting down; retry on another replica", "unavailable")
        if not state.ready:
            raise ApiError(503, "the model is still loading; retry shortly", "unavailable",
                           headers={"Retry-After": "2"})
        return state.engine

    async def fetch_kv(url: str, ids: list[int], params: SamplingParams) -> KVPayload:
        try:
            async with httpx.AsyncClient(timeout=600) as client:
                r = await client.post(url.rstrip("/") + "/v1/kv/prefill",
                                      json={"prompt_token_ids": ids, "sampling": dataclasses.asdict(params)})
        except httpx.HTTPError as e:
            raise ApiError(502, f"prefill engine {url} unreachable: {e!r}", "upstream_error")
        if r.status_code != 200:
            raise ApiError(r.status_code if r.status_code < 500 else 502, f"prefill engine {url}: {r.text[:300]}",
                           "upstream_error")
        return KVPayload.from_bytes(r.content)

    async def start(body: SamplingFields, prompt: str | list[int], params_fn, request: Request):
        engine = require_engine()
        if body.model != engine.model_name:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves "
                                f"{engine.model_name!r} (see /v1/models)", param="model")
        bad = body.unsupported()
        if bad:
            raise ApiError(400, f"unsupported parameter(s): {', '.join(bad)}", param=bad[0].split()[0])
        rid = f"{uuid.uuid4().hex[:24]}"
        try:
            params = params_fn()
            kv = None
            if request.headers.get(PREFILL_HEADER):
                kv = await fetch_kv(request.headers[PREFILL_HEADER], engine.tokenize(prompt), params)
            req, queue = state.async_engine.add(prompt, params, rid, body.priority,
                                                request.headers.get(BUCKET_HEADER, "default"), kv=kv)
        except AdmissionError as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", headers={"Retry-After": str(int(e.retry_after))})
        except ValueError as e:
            raise ApiError(400, str(e))
        return engine, rid, req, queue

    async def results(rid: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas; abort it in the engine if the consumer goes away first."""
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if out is None:
                    raise ApiError(500, "the engine failed while serving this request", "server_error")
                finished = out.finished
                yield out
        finally:
            if not finished:
                state.async_engine.abort(rid)

    async def respond(request: Request, stream: bool, chunks, full) -> Response:
        if stream:
            return StreamingResponse(chunks(), media_type="text/event-stream")
        task = asyncio.ensure_future(full())
        while True:  # a non-streaming client that disconnects must also free its blocks
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return JSONResponse(task.result())
            if await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await parse(request, CompletionRequest)
        engine, rid, req, queue = await start(body, body.single_prompt(), lambda: body.sampling_params(
            16 if body.max_tokens is None else body.max_tokens, body.logprobs), request)
        chunks, full = completion_handlers(engine, body, req, rid, results(rid, queue))
        return await respond(request, body.stream, chunks, full)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        engine = require_engine()
        try:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in body.messages]
            ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages")
        engine, rid, req, queue = await start(body, ids, lambda: body.sampling_params(
            body.resolved_max_tokens(), body.resolved_logprobs()), request)
        chunks, full = chat_handlers(engine, body, req, rid, results(rid, queue))
        return await respond(request, body.stream, chunks, full)

    @app.post("/v1/kv/prefill")
    async def kv_prefill(request: Request) -> Response:
        body: PrefillRequest = await parse(request, PrefillRequest)
        require_engine()
        rid = f"prefill-{uuid.uuid4().hex[:20]}"
        try:
            params = SamplingParams(**body.sampling)
            _, queue = state.async_engine.add(body.prompt_token_ids, params, rid, None,
                                              request.headers.get(BUCKET_HEADER, "default"), export_kv=True)
        except AdmissionError as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", headers={"Retry-After": str(int(e.retry_after))})
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e))
        outs = [out async for out in results(rid, queue)]
        if outs[-1].kv is None:
            raise ApiError(500, f"prefill ended without KV ({outs[-1].finish_reason})", "server_error")
        return Response(outs[-1].kv.to_bytes(), media_type="application/octet-stream")

    app.state.started_at = time.time()
    return app
