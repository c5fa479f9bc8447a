"""The router: a raw ASGI app in front of the engines (raw ASGI and an aiohttp client because every
microsecond here is added to every request's time to first byte).

A generation request passes: auth (401) -> size limits (413) -> per-key quota (429) -> bucket classification ->
admission and shedding by priority (429) -> replica choice -> proxy. Nothing is sent to the client before the
upstream's first body chunk, so any failure until then (refused connection, a replica killed mid-prefill, a 503
from a draining one, a 429 from a full one) is retried on another replica and the client never sees it. A client
that disconnects cancels the proxy task, which closes the upstream connection: the engine aborts the request.

Prefill/decode disaggregation: a prompt of at least `prefill_threshold_tokens` (estimated) goes to a decode
replica with the header x-slofleet-prefill-url naming a prefill replica (chosen like any replica: prefix
affinity, then load); the decode engine pulls the prompt's KV from it and computes no prompt token itself.
Shorter prompts, and long ones while no prefill replica is ready, go to a decode (or unified) replica that
prefills itself: a prefill pool scaled to zero or failing costs latency, never requests.

Scale from zero: while no replica that can serve the request is ready, it is held (up to `hold_timeout`) until
one is, and counted in slofleet:router_held_requests, the signal the autoscaler scales a pool up from zero on."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from slofleet.api import v1alpha1 as api
from slofleet.api.contract import BUCKET_HEADER, DECODE, PREFILL, PREFILL_HEADER, REPLICA_HEADER, UNIFIED

from .balancer import Balancer, prefix_key
from .buckets import Admission, Bucket, Classifier, Ticket
from .gateway import GatewayError, KeyStore, Quotas
from .metrics import RouterMetrics
from .replicas import ReplicaSet
from .wire import RoutedBody, error_body, headers_of, respond, until_disconnect

log = logging.getLogger("slofleet.router")
GENERATE = ("/v1/completions", "/v1/chat/completions")
PASS_HEADERS = (b"content-type", b"content-length", b"retry-after")
FORWARD_HEADERS = ("x-request-id", "traceparent", "tracestate")
RETRYABLE = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
SERVING = (UNIFIED, DECODE)  # roles that run whole requests; a prefill replica only ever prefills


@dataclass
class RouterConfig:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 32768
    capacity_per_replica: int = 128  # in-flight requests per ready replica before shedding starts
    max_attempts: int = 3
    affinity_chars: int = 256
    connect_timeout: float = 2.0
    replica_header: bool = False  # answer with REPLICA_HEADER (tests, debugging)
    # the resource's defaults (its field descriptions say what they do), so a local router behaves the same
    prefill_threshold_tokens: int = api.Topology.model_fields["prefill_threshold_tokens"].default
    hold_timeout: float = api.Router.model_fields["hold_timeout_seconds"].default  # waiting for a ready replica


class Router:
    def __init__(self, cfg: RouterConfig, replicas: ReplicaSet, classifier: Classifier, keys: KeyStore,
                 quotas: Quotas, balancer: Balancer):
        self.cfg, self.replicas, self.classifier = cfg, replicas, classifier
        self.keys, self.quotas, self.balancer = keys, quotas, balancer
        self.metrics = RouterMetrics()
        self.inflight = 0
        self.session: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task] = []
        balancer.set_urls(list(replicas.replicas))
        replicas.on_change = balancer.set_urls
        for b in classifier.buckets:  # present at 0 from the start, for the autoscaler to read
            self.metrics.held.labels(b.name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path in GENERATE:
            return await self.generate(scope, receive, send)
        if method == "GET" and path == "/health":
            return await respond(send, 200, b"ok", b"text/plain")
        if method == "GET" and path == "/ready":
            ok = bool(self.replicas.ready(SERVING))
            return await respond(send, 200 if ok else 503, b"ready" if ok else b"no ready replica", b"text/plain")
        if method == "GET" and path == "/metrics":
            for r in self.replicas.replicas.values():
                self.metrics.replica_up.labels(r.url).set(1 if r.ready else 0)
            return await respond(send, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST.encode())
        if method == "GET" and path == "/v1/models":
            return await self.models(scope, send)
        await respond(send, 404, error_body(404, f"no route {method} {path}", "not_found_error"))

    async def lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True), auto_decompress=False,
                    timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout))
                self.tasks = [asyncio.create_task(self.replicas.run()), asyncio.create_task(self.reload_keys())]
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                for t in self.tasks:
                    t.cancel()
                await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def reload_keys(self) -> None:
        while True:  # a rotated Secret's file changes under us; pick it up within seconds
            await asyncio.sleep(5)
            try:
                self.keys.reload()
            except OSError as e:
                log.warning("reloading API keys failed: %s", e)

    async def models(self, scope, send) -> None:
        try:
            self.keys.authenticate(headers_of(scope))
        except GatewayError as e:
            return await respond(send, e.status, error_body(e.status, e.message, e.kind))
        for r in self.replicas.ready():
            try:
                async with self.session.get(r.url + "/v1/models") as resp:
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

    async def generate(self, scope, receive, send) -> None:
        t0, path, headers = time.perf_counter(), scope["path"], headers_of(scope)
        bucket: Bucket | None = None
        try:
            quota = self.keys.authenticate(headers)
            data = json.loads(await self.read_body(receive, headers))
            body = RoutedBody.model_validate(data)
            text, n_ids = body.text_and_ids()
            tokens = n_ids if n_ids is not None else self.classifier.estimate_tokens(len(text))
            if tokens > self.cfg.max_prompt_tokens:
                raise GatewayError(413, f"prompt of ~{tokens} tokens is over the limit of {self.cfg.max_prompt_tokens}",
                                   "invalid_request_error")
            if quota is not None:
                self.quotas.charge(quota, tokens, body.output_tokens())
            bucket = self.classifier.classify(tokens, body.output_tokens(), headers, path)
            # With none ready, one replica's worth is admitted and held for the first to come up.
            ready = len(self.replicas.ready(SERVING)) or (1 if self.cfg.hold_timeout > 0 else 0)
            capacity = self.cfg.capacity_per_replica * ready
            ticket = self.classifier.admit(bucket, tokens, self.inflight, capacity)
        except GatewayError as e:
            reason = {401: "auth", 413: "size"}.get(e.status, "quota")
            return await self.reject(send, bucket, reason, e.status, e.message, e.kind, e.retry_after)
        except Admission as e:
            return await self.reject(send, bucket, "shed", 429, str(e), "rate_limit_exceeded", e.retry_after)
        except (json.JSONDecodeError, UnicodeDecodeError, ValidationError, TypeError) as e:
            return await self.reject(send, bucket, "invalid", 400, f"the request body is not an OpenAI request: {e}",
                                     "invalid_request_error")
        except asyncio.CancelledError:
            return  # the client left while sending its body
        data["priority"] = bucket.priority  # the bucket's priority, never the client's own claim
        upstream_headers = {"content-type": "application/json", BUCKET_HEADER: bucket.name,
                            **{h: headers[h] for h in FORWARD_HEADERS if h in headers}}
        key = prefix_key(text, self.cfg.affinity_chars)
        self.inflight += 1
        self.metrics.inflight.labels(bucket.name).inc()
        work = asyncio.ensure_future(self.forward(send, path, json.dumps(data).encode(), upstream_headers, key,
                                                  ticket, t0, tokens))
        watch = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()  # the client left: closing the upstream connection aborts it in the engine
            await asyncio.gather(work, return_exceptions=True)
        finally:
            watch.cancel()
            self.classifier.release(ticket)
            self.inflight -= 1
            self.metrics.inflight.labels(bucket.name).dec()

    async def reject(self, send, bucket: Bucket | None, reason: str, status: int, message: str, kind: str,
                     retry_after: int | None = None) -> None:
        name = bucket.name if bucket else "-"
        self.metrics.rejected.labels(name, reason).inc()
        self.metrics.requests.labels(name, str(status)).inc()
        extra = [(b"retry-after", str(retry_after).encode())] if retry_after else []
        await respond(send, status, error_body(status, message, kind), headers=extra)

    async def hold(self, bucket: str, deadline: float) -> bool:
        """Wait until some serving replica is ready (True) or the deadline passes (False)."""
        self.metrics.held.labels(bucket).inc()
        try:
            while not self.replicas.ready(SERVING):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self.replicas.became_ready.wait(), left)
                except asyncio.TimeoutError:
                    return False
            return True
        finally:
            self.metrics.held.labels(bucket).dec()

    async def open_upstream(self, path: str, payload: bytes, headers: dict, key: int | None, ticket: Ticket,
                            tokens: int):
        """Open the request on some replica and read its first chunk, trying others on failure. Returns
        (replica, response, first chunk), or (None, status, error body) when every try failed."""
        tried: set[str] = set()
        bad_prefill: set[str] = set()
        last: tuple[int, bytes] = (503, error_body(503, "no ready replica to serve this request", "unavailable"))
        name = ticket.bucket.name
        long_prompt = tokens >= self.cfg.prefill_threshold_tokens
        hold_until = time.monotonic() + self.cfg.hold_timeout
        for attempt in range(self.cfg.max_attempts):
            replica = self.balancer.choose(self.replicas.ready(SERVING), key, tried)
            if replica is None and not tried and not self.replicas.ready(SERVING):
                if await self.hold(name, hold_until):
                    replica = self.balancer.choose(self.replicas.ready(SERVING), key, tried)
                else:
                    last = (503, error_body(503, f"no ready replica of role {' or '.join(SERVING)} came up within "
                                                 f"{self.cfg.hold_timeout:g} s; the fleet may be scaled to zero "
                                                 "or failing", "unavailable"))
            if replica is None:
                break
            if attempt:
                self.metrics.retries.labels(name).inc()
            tried.add(replica.url)
            prefill = None
            if long_prompt:
                prefill = self.balancer.choose(self.replicas.ready((PREFILL,)), key, bad_prefill)
            how = "least-load" if key is None and self.balancer.policy == "prefix" else self.balancer.policy
            self.metrics.routed.labels(name, how).inc()
            replica.inflight += 1
            send_headers = headers
            if prefill is not None:
                prefill.inflight += 1
                send_headers = {**headers, PREFILL_HEADER: prefill.url}
            resp = None
            try:
                resp = await self.session.post(replica.url + path, data=payload, headers=send_headers)
                body = await resp.read() if resp.status >= 400 else None  # errors are small JSON bodies
                if body is not None and prefill is not None and b"prefill engine" in body:
                    # the prefill replica failed or is full, not the decode one: the same decode replica tries
                    # again with another prefill replica, or prefills itself
                    bad_prefill.add(prefill.url)
                    tried.discard(replica.url)
                    if resp.status == 502:
                        self.replicas.mark_failed(prefill, "failed for a decode replica")
                    raise LookupError
                if resp.status in (429, 503):  # full or draining: another replica may take it
                    last = (resp.status, body)
                    if resp.status == 503:
                        self.replicas.mark_failed(replica, "answered 503")
                    raise LookupError
                first = body if body is not None else await resp.content.readany()
                if path == GENERATE[1] and b'"role"' in first and first.count(b"\n\n") == 1:
                    # a chat stream opens with a role-only event before any token: hold it back until the first
                    # token, so a replica that fails during prefill is still retried elsewhere
                    first += await resp.content.readany()
                route = "disaggregated" if prefill is not None else "fallback" if long_prompt else "direct"
                self.metrics.pd_routes.labels(name, route).inc()
                return replica, resp, first
            except RETRYABLE as e:
                self.replicas.mark_failed(replica, f"{type(e).__name__}: {e}")
                last = (502, error_body(502, f"replica failed before answering: {type(e).__name__}", "bad_gateway"))
            except LookupError:
                pass
            except BaseException:
                replica.inflight -= 1
                if resp is not None:
                    resp.close()
                raise
            finally:
                if prefill is not None:
                    prefill.inflight -= 1
            replica.inflight -= 1
            if resp is not None:
                resp.close()
        return None, last[0], last[1]

    async def forward(self, send, path: str, payload: bytes, headers: dict, key: int | None, ticket: Ticket,
                      t0: float, tokens: int) -> None:
        name = ticket.bucket.name
        replica, resp, first = await self.open_upstream(path, payload, headers, key, ticket, tokens)
        self.classifier.release(ticket)  # no longer waiting: the engine has started on it
        if replica is None:
            self.metrics.requests.labels(name, str(resp)).inc()
            self.metrics.rejected.labels(name, "no_replica").inc()
            return await respond(send, resp, first, headers=[(b"retry-after", b"1")] if resp in (429, 503) else [])
        done = False
        try:
            out = [(k, v) for k, v in resp.raw_headers if k.lower() in PASS_HEADERS]
            out.append((BUCKET_HEADER.encode(), name.encode()))
            if self.cfg.replica_header:
                out.append((REPLICA_HEADER.encode(), replica.url.encode()))
            await send({"type": "http.response.start", "status": resp.status, "headers": out})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            self.metrics.ttfb.labels(name).observe(time.perf_counter() - t0)
            self.metrics.requests.labels(name, str(resp.status)).inc()
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            done = True
        except RETRYABLE as e:  # after the first byte nothing can be retried: end the response
            log.warning("replica %s failed mid-response: %s", replica.url, e)
            self.replicas.mark_failed(replica, str(e))
        finally:
            replica.inflight -= 1
            resp.release() if done else resp.close()
