"""FastAPI app: OpenAI-compatible endpoints, health/readiness, metrics.

/health answers as soon as the process is up; the model loads and warms in a background thread and
/ready turns 200 only then. On SIGTERM /ready turns 503 and new requests are refused while in-flight
ones finish (the server's graceful-shutdown timeout bounds the wait). If the engine loop dies, /health and
/ready fail at once, open requests get an error and the process exits so that the pod restarts."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slofleet.api.contract import BUCKET_HEADER, COMPLETIONS_MAX_TOKENS, KV_MAC_HEADER, PREFILL_HEADER, TPOT_HEADER
from slofleet.tracing.core import Tracing

from ..config import EngineConfig
from ..engine import LLMEngine, RequestOutput
from ..errors import AdmissionError, InvalidRequest, UpstreamError
from ..kv_transfer import KVPayload
from ..request import FinishReason
from ..request import Request as EngineRequest
from ..sampling_params import SamplingParams
from .admit import LocalAdmission, watched
from .async_engine import AsyncEngine
from .collector import DEFAULT_BUCKET, BucketLabels  # the contract's, as the engine labels it
from .guard import Guard
from .handoff import fetch_kv, is_loopback, mac, peer_base
from .http import ApiError, from_engine, parse, read_body, seconds_of_ms, unavailable
from .kv_events import KVEventPublisher
from .lifecycle import drain, for_role
from .metrics import Metrics
from .openai_format import chat_handlers, completion_handlers, tool_chat_handlers
from .protocol import ChatCompletionRequest, CompletionRequest, PrefillRequest, SamplingFields
from .settings import ServerSettings
from .tokenize import add_tokenize_routes
from .tools import chat_constraint, chat_prompt, constrained
from .tracing import Traced, add_debug_routes, handoff_span

log = logging.getLogger("slofleet.engine.api")
FATAL_EXIT_DELAY = 1.0  # seconds for open requests to receive their error before the process exits


class State:
    """What the handlers share: the engine once loaded, and the lifecycle flags."""

    def __init__(self, config: EngineConfig, settings: ServerSettings):
        self.config, self.settings = config, settings
        self.buckets = BucketLabels(config.buckets() | set(settings.bucket_ttft_map()))
        self.admission = LocalAdmission(settings.bucket_ttft_map()) if settings.bucket_ttft_ms else None
        self.engine: LLMEngine | None = None
        self.async_engine: AsyncEngine | None = None
        self.metrics: Metrics | None = None
        self.ready = False
        self.draining = False
        self.load_error: BaseException | None = None
        self.kv_events: KVEventPublisher | None = None  # with --kv-events-endpoint
        self.on_load_failure: Callable[[], None] | None = None  # `slofleet serve` stops: nothing here will serve
        self.freeze_gc = False  # this process serves one engine for its life (`slofleet serve`): see load()

    @property
    def failure(self) -> BaseException | None:
        return self.load_error or (self.async_engine and self.async_engine.error)

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            engine = LLMEngine(self.config)
            if self.settings.kv_events_endpoint:  # bound before ready: a taken port fails the start
                self.kv_events = KVEventPublisher(engine, self.settings.kv_events_endpoint,
                                                  self.settings.kv_events_replay_endpoint)
            warm = engine.add_request([engine.tokenizer.eos_token_id or 0],
                                      SamplingParams(max_tokens=2, ignore_eos=True))
            while not warm.finished:
                engine.step()
            if self.freeze_gc:  # a full collection walks the model's and libraries' objects, stalling every stream
                gc.freeze()
            self.engine, self.metrics = engine, Metrics(engine, self.settings.price_per_hour, self.buckets.known)
            self.async_engine = AsyncEngine(engine, self.metrics.observe, on_fatal=self.exit_soon,
                                            on_step=self.metrics.observe_step)
            self.async_engine.start(loop)
            self.ready = True
            log.info("ready: serving %s", engine.model_name)
        except BaseException as e:
            if isinstance(e, (OSError, ValueError)):  # a path, a setting or an address: the message says which
                log.error("model load failed: %s", e)
            else:
                log.exception("model load failed")
            self.load_error = e
            if self.on_load_failure is not None:
                self.on_load_failure()

    def exit_soon(self) -> None:
        """The engine loop died: nothing here can serve again, so let the pod restart."""
        threading.Timer(FATAL_EXIT_DELAY, os._exit, (3,)).start()

    def engine_or_503(self) -> LLMEngine:
        if self.failure is not None:
            raise ApiError(500, "the engine failed; this replica is restarting", "server_error")
        if self.draining:
            raise unavailable("the server is shutting down; retry on another replica")
        if not self.ready:
            raise unavailable("the model is still loading; retry shortly", retry_after=2)
        return self.engine


def state_of(request: Request) -> State:
    return request.app.state.slofleet


async def body_of(request: Request, model: type):
    s = state_of(request).settings
    return parse(await read_body(request, s.max_request_bytes, s.request_read_timeout), model)


# -- probes and metadata -----------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    failed = state_of(request).failure
    if failed:
        return PlainTextResponse(f"engine failed: {type(failed).__name__}", status_code=500)
    return PlainTextResponse("ok")


async def ready(request: Request) -> Response:
    state = state_of(request)
    if state.ready and not state.draining and state.failure is None:
        return PlainTextResponse("ready")
    why = "failed" if state.failure else "draining" if state.draining else "loading"
    return PlainTextResponse(why, status_code=503)


async def metrics(request: Request) -> Response:
    m = state_of(request).metrics
    return Response(b"" if m is None else generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict:
    engine = state_of(request).engine_or_503()
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "slofleet",
                                        "max_model_len": engine.max_model_len} for name in engine.model_names]}


# -- generation ----------------------------------------------------------------------------------------------
async def start(request: Request, body: SamplingFields, prompt: Callable[[LLMEngine], str | list[int]],
                params: Callable[[], SamplingParams]):
    """Check, build and queue one request; every refusal here is an ApiError before any byte is sent."""
    state = state_of(request)
    engine = state.engine_or_503()
    if body.model not in engine.model_names:
        raise ApiError(400, f"model {body.model!r} is not served here; this server serves "
                            f"{', '.join(map(repr, engine.model_names))} (see /v1/models)", param="model")
    bad = body.unsupported()
    if bad:
        raise ApiError(400, f"unsupported parameter(s): {', '.join(bad)}", param=bad[0].split()[0])
    rid, watch, req = request.state.request_id, None, None
    try:
        ids_or_text, sampling = prompt(engine), params()
        watch = state.admission and state.admission.watch(engine, bucket_of(request), body.priority, ids_or_text)
        kv = None
        if request.headers.get(PREFILL_HEADER) and sampling.n == 1:  # a hand-off carries one sample's first token
            kv = await handoff(request, engine, engine.tokenize(ids_or_text), sampling)
        req, queue = state.async_engine.add(ids_or_text, sampling, rid, body.priority, bucket_of(request), kv=kv,
                                            tpot=tpot_of(request))
        request.state.engine_request = req  # for its trace
    except AdmissionError as e:
        state.metrics.refused(bucket_of(request))
        raise from_engine(e) from None
    except (InvalidRequest, UpstreamError) as e:
        raise from_engine(e) from None
    finally:
        if watch and req is None:  # admitted, then not queued after all
            state.admission.end(watch)
    return engine, req, watched(state.admission, watch, results(state, req, queue))


async def handoff(request: Request, engine: LLMEngine, ids: list[int], sampling: SamplingParams) -> KVPayload:
    settings = state_of(request).settings
    if not request.state.internal:
        raise ApiError(403, f"{PREFILL_HEADER} is honoured only with the service's internal token (the router's)")
    base = peer_base(request.headers[PREFILL_HEADER], allow_loopback=is_loopback(settings.host))
    with handoff_span(request.state, base) as headers:
        return await fetch_kv(base, ids, sampling, settings.internal_token, engine.kv_payload_bytes(len(ids)), headers)


def tpot_of(request: Request) -> float | None:
    """The TPOT target the router sent; None (the engine's own for the bucket) from anyone else."""
    trusted = request.state.internal or not state_of(request).settings.internal_token
    return seconds_of_ms(request.headers.get(TPOT_HEADER)) if trusted else None


def bucket_of(request: Request) -> str:
    return state_of(request).buckets.label(request.headers.get(BUCKET_HEADER, DEFAULT_BUCKET))


async def results(state: State, req: EngineRequest, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    """Yield the deltas of the request's samples as they come; abort those still open in the engine if the consumer
    goes away first."""
    rid, open_ids = req.request_id, {r.request_id for r in req.samples()}
    try:
        while open_ids:
            out = await queue.get()
            if isinstance(out, ApiError):  # cut at the end of the shutdown's grace period (lifecycle.py)
                raise out
            if out is None or out.finish_reason is FinishReason.ERROR:
                raise ApiError(500, f"the engine failed while serving this request (request id {rid})",
                               "server_error")
            if out.finished:
                open_ids.discard(out.request_id)
            yield out
    finally:
        for sample_id in open_ids:
            state.async_engine.abort(sample_id)


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


async def completions(request: Request) -> Response:
    body: CompletionRequest = await body_of(request, CompletionRequest)
    try:
        params = await constrained(state_of(request).engine_or_503().grammars, lambda: body.sampling_params(
            COMPLETIONS_MAX_TOKENS if body.max_tokens is None else body.max_tokens, body.logprobs), body.constraint)
    except InvalidRequest as e:
        raise from_engine(e) from None
    engine, req, outs = await start(request, body, lambda _: body.single_prompt(), params)
    chunks, full = completion_handlers(engine, body, req, request.state.request_id, outs)
    return await respond(request, body.stream, chunks, full)


async def chat(request: Request) -> Response:
    body: ChatCompletionRequest = await body_of(request, ChatCompletionRequest)
    try:
        plan = body.tool_plan()
        params = await constrained(state_of(request).engine_or_503().grammars, lambda: body.sampling_params(
            body.resolved_max_tokens(), body.resolved_logprobs()), lambda: chat_constraint(body, plan))
    except InvalidRequest as e:
        raise from_engine(e) from None
    engine, req, outs = await start(request, body, lambda e: chat_prompt(e, body, plan), params)
    rid = request.state.request_id
    chunks, full = (tool_chat_handlers(engine, body, req, rid, outs, plan) if plan.active
                    else chat_handlers(engine, body, req, rid, outs))
    return await respond(request, body.stream, chunks, full)


async def kv_prefill(request: Request) -> Response:
    """Prefill role: compute a prompt, sample its first token, answer with its KV (see kv_transfer)."""
    body: PrefillRequest = await body_of(request, PrefillRequest)
    state = state_of(request)
    state.engine_or_503()
    rid = request.state.request_id
    try:
        params = SamplingParams(**body.sampling)
        req, queue = state.async_engine.add(body.prompt_token_ids, params, rid, None, bucket_of(request),
                                            export_kv=True)
        request.state.engine_request = req
    except TypeError as e:  # an unknown SamplingParams field
        raise ApiError(400, f"sampling: {e}") from None
    except (InvalidRequest, AdmissionError, UpstreamError) as e:
        raise from_engine(e) from None
    outs = [out async for out in results(state, req, queue)]
    if outs[-1].kv is None:
        raise ApiError(500, f"prefill ended without KV ({outs[-1].finish_reason})", "server_error")
    data, token = outs[-1].kv.to_bytes(), state.settings.internal_token
    return Response(data, media_type="application/octet-stream", headers={KV_MAC_HEADER: mac(token, data)} if token
                    else None)


# -- the app -------------------------------------------------------------------------------------------------
def build_app(config: EngineConfig, settings: ServerSettings | None = None) -> FastAPI:
    state = State(config, settings or ServerSettings())
    s = state.settings
    tracing = Tracing("engine", config.role, f"{s.host}:{s.port}", s.otlp_traces_endpoint)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        threading.Thread(target=state.load, args=(asyncio.get_running_loop(),), name="model-load",
                         daemon=True).start()
        yield
        if state.async_engine is not None:
            state.async_engine.stop()
        if state.kv_events is not None:
            state.kv_events.close()
        tracing.shutdown()

    app = FastAPI(title="slofleet engine", lifespan=lifespan)
    app.state.slofleet = state
    app.state.started_at = time.time()

    app.add_middleware(Guard, settings=state.settings)
    app.add_middleware(Traced, tracing=tracing)  # outermost: every response, a refused one too, has its request id
    app.add_exception_handler(ApiError, lambda _, exc: exc.response())
    for path, handler in (("/health", health), ("/ready", ready), ("/metrics", metrics), ("/v1/models", models)):
        app.add_api_route(path, handler, methods=["GET"])
    from .embeddings import embeddings  # these two import this module's start and respond
    from .responses import responses
    for path, handler in (("/v1/completions", completions), ("/v1/chat/completions", chat), ("/v1/kv/prefill",
                          kv_prefill), ("/v1/responses", responses), ("/v1/embeddings", embeddings)):
        app.add_api_route(path, for_role(config.role, path, handler), methods=["POST"])
    app.add_api_route("/v1/drain", drain, methods=["POST", "DELETE"])
    add_tokenize_routes(app)
    add_debug_routes(app, tracing)
    return app
