"""An admitted request's trip to a replica and back: replica choice with retries before the first byte, holding
while no replica is ready, the prefill hand-off header, and streaming the answer to the client.

Two read timeouts bound a replica that stops answering. Time to first byte (`ttfb_timeout`): one budget, from the
first replica tried, for all tries to produce a first token; once spent the client gets 504 and the engine's
request is aborted (its connection closed). Within it each try but the last has its own, shorter limit, and
retries are bounded by a budget (failover.py). Idle gap (`idle_timeout`): after the first byte, the longest silence
between two chunks; a stream cut then, by a timeout, a failed replica or the router's shutdown, ends with an SSE
error event (which the openai client raises) instead of stopping mid-way without a word.

Prefill/decode disaggregation: a prompt of at least `prefill_threshold_tokens` (estimated) goes to a decode
replica with the header x-slofleet-prefill-url naming a prefill replica (chosen like any replica: prefix
affinity, then load); the decode engine pulls the prompt's KV from it and computes no prompt token itself.
Shorter prompts, and long ones while no prefill replica is ready, go to a decode (or unified) replica that
prefills itself: a prefill pool scaled to zero or failing costs latency, never requests."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time

import aiohttp

from slofleet.api.contract import (
    BUCKET_HEADER,
    DECODE,
    PREFILL,
    PREFILL_HEADER,
    REPLICA_HEADER,
    SERVER_TIMING_HEADER,
    UNIFIED,
)
from slofleet.tracing.core import CLIENT, LeanSpan, RequestTrace

from .balancer import Balancer
from .buckets import Classifier, Ticket
from .clocks import observe
from .deadline import Deadline
from .failover import Cut, Failed, Opened, Pick, RetryBudget, Tries, early_error, try_limit
from .http1 import Pool, Response
from .metrics import RouterMetrics
from .replicas import ReplicaSet
from .wire import error_body, respond, sse_error

log = logging.getLogger("slofleet.router")
GENERATE = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")  # what goes to engines
PASS_HEADERS = (b"content-type", b"content-length", b"retry-after")
RETRYABLE = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
SERVING = (UNIFIED, DECODE)  # roles that run whole requests; a prefill replica only ever prefills
HANDOFF_TIMING = re.compile(r"kv_handoff;dur=([0-9.]+)")  # a decode engine's Server-Timing entry, in ms


class Upstream:
    def __init__(self, cfg, replicas: ReplicaSet, balancer: Balancer, classifier: Classifier,
                 metrics: RouterMetrics):
        self.cfg, self.replicas, self.balancer, self.classifier = cfg, replicas, balancer, classifier
        self.metrics = metrics
        self.pool: Pool | None = None  # the Router's, opened at startup
        self.draining = False  # set on SIGTERM: a stream cancelled from then on is one the grace period cut
        self.budget = RetryBudget(percent=cfg.retry_budget_percent, floor=cfg.retry_budget_floor)

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

    async def first_chunk(self, url: str, path: str, payload: bytes, headers: dict) -> tuple:
        """POST and read up to the first token: (response, first chunk), or the whole (small JSON) body of an
        error status."""
        resp = await self.pool.post(url, path, payload, headers)
        try:
            if resp.status >= 400:
                return resp, await resp.read()
            first = await resp.readany()
            if path == GENERATE[1] and b'"role"' in first and first.count(b"\n\n") == 1:
                # a chat stream opens with a role-only event before any token: hold it back until the first
                # token, so a replica that fails during prefill is still retried elsewhere
                first += await resp.readany()
            return resp, first
        except BaseException:
            resp.close()
            raise

    async def open(self, path: str, payload: bytes, headers: dict, key: int | None, ticket: Ticket, tokens: int,
                   rt: RequestTrace) -> Opened | Failed:
        """Open the request on some replica and read its first chunk, trying others on failure; or the answer to
        send when every try failed. Each try is a CLIENT span whose context the engine continues."""
        tries = Tries(bucket=ticket.bucket.name, long_prompt=tokens >= self.cfg.prefill_threshold_tokens,
                      hold_until=time.monotonic() + self.cfg.hold_timeout,
                      try_limit=try_limit(ticket.bucket, self.cfg.min_try_timeout, self.cfg.try_timeout))
        attempt = counted = 0  # a try on a dead replica while none is up is not counted: the request holds
        try:
            while counted < self.cfg.max_attempts:
                if attempt and not tries.retrying:
                    tries.retrying = await self.budget.acquire(tries.deadline)
                    if not tries.retrying:
                        break
                pick = await self.pick(tries, key, attempt, rt)
                if pick is None:
                    break
                opened = await self.attempt(tries, pick, path, payload, headers, attempt, rt)
                if opened is not None:
                    return opened
                if tries.spent:
                    break
                attempt, counted = attempt + 1, counted + (not tries.down or bool(self.replicas.ready(SERVING)))
        finally:
            if tries.retrying:
                self.budget.release()
        return tries.last or Failed(status=503, body=error_body(503, "no ready replica to serve this request",
                                                                "unavailable"))

    async def pick(self, tries: Tries, key: int | None, attempt: int, rt: RequestTrace) -> Pick | None:
        """The replica for this try (holding for one while none is ready), and a prefill replica for a long
        prompt; None when no replica is left to try."""
        choose, held = rt.span("choose", attempt=attempt), 0
        ready = self.replicas.ready(SERVING)
        # every ready one tried (slow, not dead): the last try goes to one of them, with the whole budget left
        replica = self.balancer.choose(ready, key, tries.tried) or self.balancer.choose(ready, key, set())
        if replica is None:
            # none ready, at first or after a failed try (a fleet restarting): wait for one, a restarted one too
            h0 = time.time_ns()
            ready = await self.hold(tries.bucket, min(tries.hold_until, tries.deadline or tries.hold_until))
            held = time.time_ns() - h0
            rt.span("hold", h0, h0 + held, parent=choose, ready=ready)
            self.metrics.phase.labels(tries.bucket, "hold").observe(held / 1e9)
            if ready:
                replica = self.balancer.choose(self.replicas.ready(SERVING), key, set())
            elif tries.last is None:  # else the last try's own answer says more
                tries.last = Failed(status=503, body=error_body(
                    503, f"no ready replica of role {' or '.join(SERVING)} came up within {self.cfg.hold_timeout:g} "
                    "s; the fleet may be scaled to zero or failing", "unavailable"))
        if replica is None:
            choose.end()
            return None
        if attempt:
            self.metrics.retries.labels(tries.bucket).inc()
        tries.deadline = tries.deadline or time.monotonic() + self.cfg.ttfb_timeout  # held time is not the replica's
        tries.tried.add(replica.url)
        tries.first_url = tries.first_url or replica.url
        prefill = None
        if tries.long_prompt:
            prefill = self.balancer.choose(self.replicas.ready((PREFILL,)), key, tries.bad_prefill)
        how = self.balancer.how(key)
        self.metrics.routed.labels(tries.bucket, how).inc()
        choose.note(how=how)
        choose.end()
        self.metrics.phase.labels(tries.bucket, "choose").observe((choose.end_time - choose.start_time - held) / 1e9)
        return Pick(replica=replica, prefill=prefill)

    async def attempt(self, tries: Tries, pick: Pick, path: str, payload: bytes, headers: dict, attempt: int,
                      rt: RequestTrace) -> Opened | None:
        """One try: the opened answer, or None with `tries` told why (and whether the budget is spent)."""
        replica, prefill, tries.down = pick.replica, pick.prefill, False
        span = rt.span("upstream", kind=CLIENT, attempt=attempt, replica=replica.url,
                       prefill_replica=prefill.url if prefill else None)
        tries.first_try = tries.first_try or span.start_time
        replica.inflight += 1
        send_headers = {**headers, **rt.headers(span)}
        if prefill is not None:
            prefill.inflight += 1
            send_headers[PREFILL_HEADER] = prefill.url
        resp, outcome, opened, left = None, "cancelled", None, tries.deadline - time.monotonic()
        limit = min(left, tries.try_limit) if self.another(tries, attempt) else left
        try:
            async with Deadline(limit):
                resp, first = await self.first_chunk(replica.url, path, payload, send_headers)
            outcome = self.refusal(tries, pick, resp.status, first)
            if outcome is None:
                opened = self.opened(tries, pick, resp, first, span)
                return opened
        except asyncio.TimeoutError:  # busy or hung, not dead: it stays in rotation until it is an outlier
            self.replicas.failed(replica, f"no first byte within {limit:.3g} s", out=False)
            if limit < left:
                outcome = "try_timeout"
                return None
            outcome, tries.spent = "timeout", True
            tries.last = Failed(status=504, body=error_body(
                504, f"no replica started answering within {self.cfg.ttfb_timeout:g} s (an answer that is not "
                "streamed starts only once it is whole: stream long generations, or raise --upstream-ttfb-timeout)",
                "gateway_timeout"))
        except OSError as e:  # its connect timeout too (a ConnectionError): a dead replica, not a slow one
            outcome, tries.down = "failed", True
            self.replicas.failed(replica, f"{type(e).__name__}: {e}")
            tries.last = Failed(status=502, body=error_body(
                502, f"replica failed before answering: {type(e).__name__}", "bad_gateway"))
        finally:
            if prefill is not None:
                prefill.inflight -= 1
            if opened is None:  # every try but the answering one, a cancelled one included
                span.note(outcome=outcome)
                span.end()
                replica.inflight -= 1
                if resp is not None:
                    resp.close()
        return None

    def another(self, tries: Tries, attempt: int) -> bool:
        """Whether a try that runs out of its own limit can be followed by another now."""
        return (attempt + 1 < self.cfg.max_attempts and (tries.retrying or self.budget.room())
                and any(r.url not in tries.tried for r in self.replicas.ready(SERVING)))

    def refusal(self, tries: Tries, pick: Pick, status: int, first: bytes) -> str | None:
        """Why an answer with this status is one to try elsewhere, or None to relay it."""
        if status >= 400 and pick.prefill is not None and b"prefill engine" in first:
            # the prefill replica failed or is full, not the decode one: the same decode replica tries again
            # with another prefill replica, or prefills itself
            tries.bad_prefill.add(pick.prefill.url)
            tries.tried.discard(pick.replica.url)
            if status == 502:
                self.replicas.mark_failed(pick.prefill, "failed for a decode replica")
            return "prefill_failed"
        if status in (429, 503):  # full or draining: another replica may take it
            tries.last = Failed(status=status, body=first)
            if status == 503:
                self.replicas.failed(pick.replica, "answered 503")
            return f"refused_{status}"
        early = early_error(first) if status == 200 else None
        if early is not None:  # no token sent yet: another replica may take it
            tries.last = early
            self.replicas.failed(pick.replica, "ended a stream before its first token")
            return "error_before_token"
        return None

    def opened(self, tries: Tries, pick: Pick, resp: Response, first: bytes, span: LeanSpan) -> Opened:
        disaggregated = pick.prefill is not None
        route = "disaggregated" if disaggregated else "fallback" if tries.long_prompt else "direct"
        self.metrics.pd_routes.labels(tries.bucket, route).inc()
        self.replicas.answered(pick.replica)
        if pick.replica.url != tries.first_url:
            self.metrics.failovers.labels(tries.bucket).inc()
        self.observe_try(tries.bucket, span, tries.first_try, resp, disaggregated)
        span.note(route=route, status=resp.status)
        return Opened(replica=pick.replica, resp=resp, first=first, span=span,
                      waited=(time.time_ns() - span.start_time) / 1e9)

    def observe_try(self, bucket: str, span, first_try: int, resp, disaggregated: bool) -> None:
        """The answering try's phases: the tries lost before it, and the decode engine's KV hand-off."""
        if span.start_time > first_try:
            self.metrics.phase.labels(bucket, "retry").observe((span.start_time - first_try) / 1e9)
        if not disaggregated:
            return
        handoff = HANDOFF_TIMING.search(resp.header(SERVER_TIMING_HEADER.encode()) or "")
        if handoff:
            self.metrics.phase.labels(bucket, "handoff").observe(float(handoff.group(1)) / 1e3)

    async def forward(self, send, sink, path: str, payload: bytes, headers: dict, key: int | None, ticket: Ticket,
                      t0: float, tokens: int, rt: RequestTrace) -> int:
        """Relay the answer (its first chunk by `send`, the rest straight into `sink`, the front's Exchange); the
        status sent."""
        self.budget.active += 1
        try:
            return await self.relay(send, sink, path, payload, headers, key, ticket, t0, tokens, rt)
        finally:
            self.budget.active -= 1

    async def relay(self, send, sink, path: str, payload: bytes, headers: dict, key: int | None, ticket: Ticket,
                    t0: float, tokens: int, rt: RequestTrace) -> int:
        name = ticket.bucket.name
        opened = await self.open(path, payload, headers, key, ticket, tokens, rt)
        # no longer waiting: the engine has started on it (the predictor learns from which one, and when)
        self.classifier.release(ticket, None if isinstance(opened, Failed) else opened.replica.url)
        if isinstance(opened, Failed):
            self.metrics.missed(ticket.bucket)
            return await self.refuse(send, name, opened)
        replica, resp, first, span, waited = opened.replica, opened.resp, opened.first, opened.span, opened.waited
        self.metrics.phase.labels(name, "upstream").observe(waited)
        done, last, cut, chunks, t_first = False, first, None, 1, None
        streamed = resp.content_type == "text/event-stream"
        try:
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": self.headers_out(resp, name, replica.url)})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            t_first, ttfb = time.time_ns(), time.perf_counter() - t0
            self.metrics.ttfb.labels(name).observe(ttfb)
            if streamed:
                self.metrics.ttft.labels(name).observe(ttfb)
            self.metrics.phase.labels(name, "own").observe(max(0.0, ttfb - waited))
            self.metrics.requests.labels(name, str(resp.status)).inc()
            resp.watch(self.cfg.idle_timeout)
            await resp.relay(sink)
            # the relay has ended the answer, but for one that ran to the connection's end (no length)
            await send({"type": "http.response.body", "body": b""})
            done = True
            observe(self.metrics, ticket.bucket, resp.status, first, resp.progress(), t0, t0 + ttfb, streamed)
        except asyncio.TimeoutError:  # the idle timer (resp.watch): the replica went quiet (it stays in rotation)
            cut = Cut(reason="idle_timeout", status=504, message=f"the replica sent nothing for "
                      f"{self.cfg.idle_timeout:g} s", kind="gateway_timeout")
        except RETRYABLE as e:  # after the first byte nothing can be retried: end the response
            self.replicas.failed(replica, str(e))
            cut = Cut(reason="replica_failed", status=502, message=f"the replica failed mid-response: "
                      f"{type(e).__name__}", kind="bad_gateway")
        except asyncio.CancelledError:  # the client left, or the shutdown's grace period ran out
            if self.draining:
                cut = Cut(reason="shutdown", status=503, message="the router is shutting down; retry the request",
                          kind="unavailable")
            raise
        finally:
            replica.ended()
            got = resp.progress()
            chunks, last = chunks + got.chunks, got.tail or last
            resp.release() if done else resp.close()
            if cut is not None:
                self.metrics.missed(ticket.bucket)
                await self.end_cut_stream(send, resp, name, last, replica.url, cut)
            if t_first is not None:
                end = time.time_ns()
                rt.span("stream", t_first, end, chunks=chunks, cut=cut and cut.reason)
                self.metrics.phase.labels(name, "stream").observe((end - t_first) / 1e9)
                self.classifier.streamed(ticket, chunks, (end - t_first) / 1e9)
            span.end()
        return resp.status

    def headers_out(self, resp, bucket: str, url: str) -> list[tuple[bytes, bytes]]:
        """The replica's headers that the client may see, with the bucket (and the replica, when asked)."""
        out = [(k, v) for k, v in resp.raw_headers if k.lower() in PASS_HEADERS]
        out.append((BUCKET_HEADER.encode(), bucket.encode()))
        if self.cfg.replica_header:
            out.append((REPLICA_HEADER.encode(), url.encode()))
        return out

    async def refuse(self, send, bucket: str, failed: Failed) -> int:
        self.metrics.requests.labels(bucket, str(failed.status)).inc()
        self.metrics.rejected.labels(bucket, "timeout" if failed.status == 504 else "no_replica").inc()
        retry = [(b"retry-after", b"1")] if failed.status in (429, 503) else []
        await respond(send, failed.status, failed.body, headers=retry)
        return failed.status

    async def end_cut_stream(self, send, resp, bucket: str, last: bytes, url: str, cut: Cut) -> None:
        log.warning("stream from replica %s cut: %s", url, cut.message)
        self.metrics.cut.labels(bucket, cut.reason).inc()
        if resp.content_type != "text/event-stream":
            return  # a JSON answer short of its content-length: the client sees the connection close early
        sep = b"" if last.endswith(b"\n\n") else b"\n\n"  # end a half-sent event first
        with contextlib.suppress(Exception):  # the client may be gone
            await send({"type": "http.response.body", "body": sep + sse_error(cut.status, cut.message, cut.kind)
                        + b"data: [DONE]\n\n"})
