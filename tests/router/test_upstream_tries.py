"""Upstream.open's tries in process, against replicas that answer in scripted ways: every try gives back the
replica's in-flight count, the time-to-first-byte budget ends the tries with 504, and a refusal moves on to the
next replica."""
from __future__ import annotations

import asyncio
import json

from slofleet.api.contract import ROUTER, UNIFIED
from slofleet.router.balancer import Balancer
from slofleet.router.buckets import DEFAULT_BUCKETS, Classifier
from slofleet.router.metrics import RouterMetrics
from slofleet.router.proxy import RouterConfig
from slofleet.router.replicas import ReplicaSet
from slofleet.router.upstream import Failed, Opened, Upstream
from slofleet.tracing.core import Tracing
from tests.router.helpers import Answer

A, B = "http://a:1", "http://b:1"


class Pool:
    """Each replica's scripted answer: an Answer, or None to never answer."""

    def __init__(self, script: dict[str, Answer | None]):
        self.script, self.asked = script, []

    async def post(self, url: str, path: str, payload: bytes, headers: dict) -> Answer:
        self.asked.append(url)
        if self.script[url] is None:
            await asyncio.sleep(3600)
        return self.script[url]


def open_with(script: dict[str, Answer | None], **cfg) -> tuple[Opened | Failed, ReplicaSet, Pool]:
    async def go():
        replicas = ReplicaSet(static={u: UNIFIED for u in script})
        for r in replicas.replicas.values():
            r.ready = True
        classifier = Classifier(DEFAULT_BUCKETS)
        up = Upstream(RouterConfig(**cfg), replicas, Balancer("least-load"), classifier, RouterMetrics())
        up.pool = Pool(script)
        ticket = classifier.admit(DEFAULT_BUCKETS[0], 10, 0, 10)
        rt = Tracing("router", ROUTER).begin("POST", "/v1/completions", {}, "rid")
        got = await up.open("/v1/completions", b"{}", {}, None, ticket, 10, rt)
        return got, replicas, up.pool
    return asyncio.run(go())


def test_a_try_past_the_first_byte_budget_answers_504_and_frees_its_replica():
    got, replicas, pool = open_with({A: None}, ttfb_timeout=0.2)
    assert isinstance(got, Failed) and got.status == 504
    assert json.loads(got.body)["error"]["type"] == "gateway_timeout"
    assert pool.asked == [A] and replicas.replicas[A].inflight == 0
    assert replicas.replicas[A].ready  # slow, not dead: it stays in rotation


def test_a_full_replica_is_skipped_for_the_next_and_frees_its_count():
    full, ok = Answer(429, b'{"error": "full"}'), Answer(200, b"data: {}\n\n")
    got, replicas, pool = open_with({A: full, B: ok})
    assert isinstance(got, Opened) and got.first == ok.body and got.resp is ok
    assert sorted(pool.asked) == [A, B] and full.closed and not ok.closed
    assert replicas.replicas[A].inflight == 0 and replicas.replicas[B].inflight == 1  # until the relay ends


def test_every_replica_refusing_answers_the_last_refusal():
    # each taken out: the request waits (hold_timeout) for one to come back, then answers the last refusal
    got, replicas, _ = open_with({A: Answer(503, b'{"e": 1}'), B: Answer(503, b'{"e": 2}')}, hold_timeout=0.3)
    assert isinstance(got, Failed) and got.status == 503 and got.body in (b'{"e": 1}', b'{"e": 2}')
    assert all(r.inflight == 0 and not r.ready for r in replicas.replicas.values())  # a 503 takes it out
