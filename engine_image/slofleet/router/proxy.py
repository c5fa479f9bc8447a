"""The router: a raw ASGI app in front of the engines (raw ASGI and its own HTTP/1.1 client, http1.py, because
every microsecond here is added to every request's time to first byte, and to every streamed chunk).

A generation request passes: auth (401) -> size limits (413) -> validation of what quotas charge (400) ->
per-key quota (429) -> bucket classification -> admission and shedding by priority (429) -> replica choice ->
proxy (upstream.py). Nothing is sent to the client before the upstream's first body chunk, so any failure until
then (refused connection, a replica killed mid-prefill, a 503 from a draining one, a 429 from a full one) is
retried on another replica and the client never sees it. A client that disconnects cancels the proxy task, which
closes the upstream connection: the engine aborts the request. A client must send its whole body within
`body_timeout` (408), so a slow one cannot hold a request open.

Scale from zero: while no replica that can serve the request is ready, it is held (up to `hold_timeout`) until
one is, and counted in slofleet:router_held_requests, the signal the autoscaler scales a pool up from zero on.

Draining (SIGTERM, see server.py): /ready and new generation requests answer 503 at once, open streams go on."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from slofleet.api import v1alpha1 as api
from slofleet.api.base import error_text
from slofleet.api.contract import (
    BUCKET_HEADER,
    COMPLETIONS_MAX_TOKENS,
    PRIORITY_RUNTIMES,
    REQUEST_ID_HEADER,
    ROUTER,
    SLOFLEET,
    TPOT_HEADER,
)
from slofleet.tracing.core import RequestTrace, Tracing, request_id, with_request_id

from .balancer import Balancer, Prefix
from .buckets import Admission, Bucket, Classifier, Ticket, asks_of
from .deadline import Deadline
from .debug import debug_traces
from .exchange import RELAY, Exchange
from .gateway import GatewayError, KeyStore, Quotas, parse_json
from .http1 import Pool
from .metrics import RouterMetrics
from .replicas import ReplicaSet
from .tokenize import TOKENIZE, tokenize
from .upstream import GENERATE, RETRYABLE, SERVING, Upstream
from .wire import RoutedBody, error_body, headers_of, internal_auth, respond, with_field

log = logging.getLogger("slofleet.router")


@dataclass
class RouterConfig:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 32768
    capacity_per_replica: int = 128  # in-flight requests per ready replica before shedding starts
    max_attempts: int = 3
    affinity_chars: int = 256
    connect_timeout: float = 2.0
    # A long prompt queued behind others on a CPU engine still starts within it; a hung engine does not hold
    # the request for ever.
    ttfb_timeout: float = 300.0  # request sent to its first token, over all tries (then 504)
    idle_timeout: float = 60.0  # the longest silence between two chunks of a started answer (then an SSE error)
    # failover.py: one try's wait for a first byte while another replica can be tried (the bucket's TTFT target,
    # within these bounds), and the retries in flight allowed (a share of the requests in flight, or the floor)
    min_try_timeout: float = 1.0
    try_timeout: float = 30.0
    retry_budget_percent: float = 20.0
    retry_budget_floor: int = 3
    body_timeout: float = 30.0  # for the client to send its whole request body (then 408)
    replica_header: bool = False  # answer with REPLICA_HEADER (tests, debugging)
    # the resource's defaults (its field descriptions say what they do), so a local router behaves the same
    prefill_threshold_tokens: int = api.Topology.model_fields["prefill_threshold_tokens"].default
    hold_timeout: float = api.Router.model_fields["hold_timeout_seconds"].default  # waiting for a ready replica
    # the engines' context length until one lists its own in /v1/models (the operator passes the resource's)
    max_model_len: int = api.Engine.model_fields["max_model_len"].default
    otlp_traces_endpoint: str = ""  # OTLP/HTTP collector for the router's spans (kept in memory either way)
    runtime: str = SLOFLEET  # the server behind the router (spec.engine.runtime): what the body may carry


@dataclass(slots=True, kw_only=True)
class Admitted:
    """A generation request past the gateway and admission, with what forwarding it needs."""
    raw: bytes  # the body as the client sent it
    data: dict[str, Any]  # the body parsed
    body: RoutedBody
    text: str  # the flattened prompt, for prefix affinity
    tokens: int  # the prompt's tokens, counted or estimated
    key: int | Prefix | None  # its affinity, for the replica choice
    bucket: Bucket
    ticket: Ticket
    t_gateway: int  # ns: the gateway's checks done
    t_classify: int  # ns: classified and admitted


class Router:
    def __init__(self, cfg: RouterConfig, replicas: ReplicaSet, classifier: Classifier, keys: KeyStore,
                 quotas: Quotas, balancer: Balancer):
        self.cfg, self.replicas, self.classifier = cfg, replicas, classifier
        self.keys, self.quotas, self.balancer = keys, quotas, balancer
        self.metrics = RouterMetrics()
        self.tracing = Tracing("router", ROUTER, otlp_endpoint=cfg.otlp_traces_endpoint)
        self.upstream = Upstream(cfg, replicas, balancer, classifier, self.metrics)
        self.inflight = 0
        self.session: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task] = []
        self.listed(list(replicas.replicas))
        replicas.on_change = self.listed
        for b in classifier.buckets:
            self.metrics.zero(b.name, balancer.hows())

    def listed(self, urls: list[str]) -> None:
        """The replicas listed changed."""
        self.balancer.set_urls(urls)
        self.classifier.predictor.keep(urls)

    async def __call__(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        headers = headers_of(scope)
        rid = request_id(headers.get(REQUEST_ID_HEADER))
        send = with_request_id(send, rid)
        if method == "POST" and path in GENERATE:
            return await self.generate(scope, receive, send, headers, rid)
        if method == "GET" and path == "/health":
            return await respond(send, 200, b"ok", b"text/plain")
        if method == "GET" and path == "/ready":
            ok = not self.draining and bool(self.replicas.ready(SERVING))
            why = b"draining" if self.draining else b"no ready replica"
            return await respond(send, 200 if ok else 503, b"ready" if ok else why, b"text/plain")
        if method == "GET" and path == "/metrics":
            for r in self.replicas.replicas.values():
                self.metrics.replica_up.labels(r.url).set(1 if r.ready else 0)
            if self.balancer.precise is not None:
                self.metrics.index(self.balancer.precise.index)
            return await respond(send, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST.encode())
        if method == "GET" and path == "/v1/models":
            return await self.models(scope, send)
        if method == "POST" and path in TOKENIZE:
            return await tokenize(self, scope, receive, send, headers)
        if method == "GET" and (path == "/debug/traces" or path.startswith("/debug/traces/")):
            return await debug_traces(self, scope, send)
        await respond(send, 404, error_body(404, f"no route {method} {path}", "not_found_error"))

    @property
    def draining(self) -> bool:
        return self.upstream.draining

    def drain(self) -> None:
        log.info("draining: /ready and new requests answer 503, %d open requests may finish", self.inflight)
        self.upstream.draining = True

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout),
            headers=internal_auth())  # /v1/models and trace look-ups; a client's own is never sent
        self.upstream.pool = Pool(self.cfg.connect_timeout, internal_auth())  # generation requests
        self.tasks = [asyncio.create_task(self.replicas.run()), asyncio.create_task(self.reload_keys())]
        if self.balancer.precise is not None:
            self.tasks.append(asyncio.create_task(self.balancer.precise.subscriptions.start()))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await self.session.close()
        self.upstream.pool.close()
        self.tracing.shutdown()

    async def reload_keys(self) -> None:
        while True:  # a rotated Secret's file changes under us, the buckets' ConfigMap too; pick them up within seconds
            await asyncio.sleep(5)
            self.keys.reload()  # a bad file is logged there, and the keys loaded before stay
            self.classifier.reload()  # the same for the buckets

    async def models(self, scope, send) -> None:
        try:
            self.keys.authenticate(headers_of(scope))
        except GatewayError as e:
            return await respond(send, e.status, error_body(e.status, e.message, e.kind))
        for r in self.replicas.ready():
            try:
                async with self.session.get(r.url + "/v1/models",
                                            timeout=aiohttp.ClientTimeout(total=self.cfg.idle_timeout)) as resp:
                    return await respond(send, resp.status, await resp.read())
            except RETRYABLE as e:
                self.replicas.mark_failed(r, str(e))
        await respond(send, 503, error_body(503, "no ready replica", "unavailable"))

    async def read_body(self, receive, headers: dict[str, str]) -> bytes:
        limit = self.cfg.max_body_bytes
        if int(headers.get("content-length") or 0) > limit:
            raise GatewayError(413, f"request body over the limit of {limit} bytes", "invalid_request_error")
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise GatewayError(413, f"request body over the limit of {limit} bytes", "invalid_request_error")
            more = msg.get("more_body", False)
        return b"".join(chunks)

    def output_bound(self, path: str, prompt_tokens: int, requested: int | None) -> int:
        """The output tokens to charge: what the engine may generate for this request, never past its context
        (absent max_tokens, a chat completion may run to the end of the context)."""
        room = max(1, (self.replicas.max_model_len or self.cfg.max_model_len) - prompt_tokens)
        if path == GENERATE[3]:  # embeddings generate nothing
            return 0
        if requested is None:
            requested = COMPLETIONS_MAX_TOKENS if path == GENERATE[0] else room
        return min(requested, room)

    async def generate(self, scope, receive, send, headers: dict[str, str], rid: str) -> None:
        status = None
        rt = self.tracing.begin("POST", scope["path"], headers, rid)
        try:
            status = await self.serve(scope, receive, send, headers, rt)
        finally:
            rt.end(status)

    async def serve(self, scope, receive, send, headers: dict[str, str], rt: RequestTrace) -> int | None:
        """One generation request through the gateway, classification and the upstream: the status answered."""
        t0, path, ex = time.perf_counter(), scope["path"], scope["extensions"][RELAY]
        if self.draining:
            return await self.reject(send, None, "draining", 503, "the router is shutting down; retry the request",
                                     "unavailable", 1)
        req = await self.admit(path, receive, send, headers, ex)
        if not isinstance(req, Admitted):
            return req
        bucket = req.bucket
        rt.span("gateway", rt.start_ns, req.t_gateway, prompt_tokens=req.tokens)
        rt.span("classify", req.t_gateway, req.t_classify, bucket=bucket.name, priority=bucket.priority)
        self.metrics.phase.labels(bucket.name, "gateway").observe((req.t_gateway - rt.start_ns) / 1e9)
        self.metrics.phase.labels(bucket.name, "classify").observe((req.t_classify - req.t_gateway) / 1e9)
        return await self.relay(path, send, ex, req, t0, rt)

    async def admit(self, path: str, receive, send, headers: dict[str, str], ex: Exchange) -> Admitted | int | None:
        """Authentication, limits, quota, classification and admission: the admitted request, or the status it
        was refused with (None when the client left while sending its body)."""
        bucket: Bucket | None = None
        try:
            quota = self.keys.authenticate(headers)
            raw = await self.read_body_in_time(receive, headers, ex)
            data = parse_json(raw)
            body = RoutedBody.model_validate(data)
            prompt = body.flat_prompt()
            tokens = prompt.ids if prompt.ids is not None else self.classifier.estimate_tokens(len(prompt.text))
            if tokens > self.cfg.max_prompt_tokens:
                raise GatewayError(413, f"prompt of ~{tokens} tokens is over the limit of {self.cfg.max_prompt_tokens}",
                                   "invalid_request_error")
            if quota is not None:
                self.quotas.charge(quota, tokens, self.output_bound(path, tokens, body.output_tokens()))
            t_gateway = time.time_ns()
            bucket = self.classifier.classify(tokens, body.output_tokens(), headers, path, asks_of(data))
            key = self.balancer.key(body.messages, body.prompt, prompt.text, self.cfg.affinity_chars)
            serving = self.replicas.ready(SERVING)
            target = self.balancer.preview(serving, key)
            # With none ready, one replica's worth is admitted and held for the first to come up.
            ready = len(serving) or (1 if self.cfg.hold_timeout > 0 else 0)
            ticket = self.classifier.admit(bucket, tokens, self.inflight, self.cfg.capacity_per_replica * ready,
                                           target.url if target is not None else None, data.get("stream") is True)
        except GatewayError as e:
            reason = {400: "invalid", 401: "auth", 408: "slow_client", 413: "size"}.get(e.status, "quota")
            return await self.reject(send, bucket, reason, e.status, e.message, e.kind, e.retry_after)
        except Admission as e:
            self.metrics.refused(bucket.name, e.reason)
            return await self.reject(send, bucket, "shed", 429, str(e), "rate_limit_exceeded", e.retry_after)
        except ValidationError as e:
            return await self.reject(send, bucket, "invalid", 400, f"invalid request: {error_text(e)}",
                                     "invalid_request_error")
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            return await self.reject(send, bucket, "invalid", 400, f"the request body is not an OpenAI request: {e}",
                                     "invalid_request_error")
        except asyncio.CancelledError:
            return None  # the client left while sending its body
        self.metrics.admitted(bucket.name, bucket.admission_mode())
        return Admitted(raw=raw, data=data, body=body, text=prompt.text, tokens=tokens, key=key, bucket=bucket,
                        ticket=ticket, t_gateway=t_gateway, t_classify=time.time_ns())

    async def read_body_in_time(self, receive, headers: dict[str, str], ex: Exchange) -> bytes:
        try:  # no timer to arm when the whole body came with the head
            async with contextlib.nullcontext() if ex.complete else Deadline(self.cfg.body_timeout):
                return await self.read_body(receive, headers)
        except asyncio.TimeoutError:
            raise GatewayError(408, f"the request body did not arrive within {self.cfg.body_timeout:g} s",
                               "invalid_request_error") from None

    async def relay(self, path: str, send, ex: Exchange, req: Admitted, t0: float, rt: RequestTrace) -> int | None:
        """Forward an admitted request and relay its answer; a client that leaves cancels it."""
        bucket = req.bucket
        # the trace context goes per try (each its own span); the request id is the one the client was answered with
        upstream_headers = {"content-type": "application/json", BUCKET_HEADER: bucket.name,
                            REQUEST_ID_HEADER: rt.request_id}
        if bucket.slo is not None and bucket.slo.tpot_ms:  # bounds the prompt work of the engine's steps beside it
            upstream_headers[TPOT_HEADER] = str(bucket.slo.tpot_ms)
        key = req.key
        self.inflight += 1
        self.metrics.inflight.labels(bucket.name).inc()
        # The answer is relayed in this task; the front calls back when the client leaves, which cancels it
        # (closing the upstream connection aborts the request in the engine). No second task per request.
        task, left = asyncio.current_task(), False

        def client_left() -> None:
            nonlocal left
            left = True
            task.cancel()

        ex.on_disconnect = client_left
        try:
            if ex.gone:  # it left before the callback was set
                client_left()
            # the bucket's priority, never the client's own claim, to the runtimes that order their queue by it
            payload = with_field(req.raw, req.data, "priority", bucket.priority) \
                if self.cfg.runtime in PRIORITY_RUNTIMES else req.raw
            return await self.upstream.forward(send, ex, path, payload, upstream_headers, key, req.ticket, t0,
                                               req.tokens, rt)
        except asyncio.CancelledError:
            if not left:  # cancelled from outside: the shutdown's grace period ran out
                raise
            if hasattr(task, "uncancel"):  # Python 3.11+: this task goes on, not cancelled
                task.uncancel()
            return None
        finally:
            ex.on_disconnect = None  # once the answer is complete, a disconnect cancels nothing
            self.classifier.release(req.ticket)
            self.inflight -= 1
            self.metrics.inflight.labels(bucket.name).dec()

    async def reject(self, send, bucket: Bucket | None, reason: str, status: int, message: str, kind: str,
                     retry_after: int | None = None) -> int:
        name = bucket.name if bucket else "-"
        self.metrics.rejected.labels(name, reason).inc()
        self.metrics.missed(bucket)  # refused counts as not within the SLO
        self.metrics.requests.labels(name, str(status)).inc()
        extra = [(b"retry-after", str(retry_after).encode())] if retry_after else []
        await respond(send, status, error_body(status, message, kind), headers=extra)
        return status
