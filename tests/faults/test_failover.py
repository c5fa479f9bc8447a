"""Router failover in process, against replicas scripted to fail the ways a dead, reset, hung or draining one does:
each failure before the first byte is retried on another replica (a span and a `retries` count per try, a
`failovers` count when another replica answered), a hung try is abandoned after its own limit (the bucket's TTFT
target), only the last try waits out the whole time-to-first-byte budget, the retry budget bounds the retries in
flight without dropping a request, and a replica failing in a row is ejected until its time is served."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from slofleet.api.contract import DECODE, PREFILL, PREFILL_HEADER, ROUTER, UNIFIED
from slofleet.router.balancer import Balancer
from slofleet.router.buckets import Classifier, RoutedBucket
from slofleet.router.failover import RetryBudget, early_error, try_limit
from slofleet.router.metrics import RouterMetrics
from slofleet.router.proxy import RouterConfig
from slofleet.router.replicas import ReplicaSet
from slofleet.router.upstream import Failed, Opened, Upstream
from slofleet.tracing.core import Tracing
from tests.router.helpers import Answer

A, B, C = "http://a:1", "http://b:1", "http://c:1"
CHAT = RoutedBucket.model_validate({"name": "chat", "slo": {"ttftMs": 200}})
OK = b"data: {}\n\n"
HANG = "hang"


class Pool:
    """Each replica's scripted answers, one per try in order (the last repeats): an Answer, an OSError to raise
    (refused, reset), HANG to never answer, or (seconds, one of those) to do it after a while. Records each try's
    URL, prefill header and whether it was abandoned, and the most tries open on each replica at once."""

    def __init__(self, script: dict[str, list]):
        self.script, self.asked, self.abandoned = script, [], []
        self.open, self.most = dict.fromkeys(script, 0), dict.fromkeys(script, 0)

    async def post(self, url: str, path: str, payload: bytes, headers: dict) -> Answer:
        self.asked.append((url, headers.get(PREFILL_HEADER)))
        answers = self.script[url]
        what = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(what, tuple):
            self.open[url] += 1
            self.most[url] = max(self.most[url], self.open[url])
            try:
                await asyncio.sleep(what[0])
            finally:
                self.open[url] -= 1
            what = what[1]
        if isinstance(what, OSError):
            raise what
        if what == HANG:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.abandoned.append(url)
                raise
        return what


def upstream(script: dict[str, list], roles: dict[str, str] | None = None, **cfg) -> Upstream:
    replicas = ReplicaSet(static=roles or dict.fromkeys(script, UNIFIED))
    for r in replicas.replicas.values():
        r.ready = True
    up = Upstream(RouterConfig(**cfg), replicas, Balancer("round-robin"), Classifier([CHAT]), RouterMetrics())
    up.pool = Pool(script)
    return up


async def ask(up: Upstream, tokens: int = 10) -> tuple[Opened | Failed, list]:
    ticket = up.classifier.admit(CHAT, tokens, 0, 10)
    rt = Tracing("router", ROUTER).begin("POST", "/v1/completions", {}, "rid")
    got = await up.open("/v1/completions", b"{}", {}, None, ticket, tokens, rt)
    return got, [s.kw for s in rt.spans if s.name == "upstream"]


def value(up: Upstream, family: str) -> float:
    return getattr(up.metrics, family).labels("chat").value


@pytest.mark.parametrize("fault", [ConnectionRefusedError("refused"), ConnectionResetError("reset"),
                                   Answer(503, b'{"error": "draining"}')], ids=["refused", "reset", "draining"])
def test_a_failure_before_the_first_byte_is_retried_on_another_replica(fault):
    async def go():
        up = upstream({A: [fault], B: [Answer(200, OK)]})
        got, spans = await ask(up)
        assert isinstance(got, Opened) and got.replica.url == B
        assert [s["replica"] for s in spans] == [A, B] and [s["attempt"] for s in spans] == [0, 1]
        assert spans[0]["outcome"] in ("failed", "refused_503") and spans[1]["route"] == "direct"
        assert value(up, "retries") == 1 and value(up, "failovers") == 1
        assert not up.replicas.replicas[A].ready and up.replicas.replicas[A].inflight == 0
        assert up.budget.retrying == 0  # its retry slot given back
    asyncio.run(go())


def test_a_hung_replica_costs_one_try_limit_not_the_whole_budget():
    async def go():
        up = upstream({A: [HANG], B: [Answer(200, OK)]}, ttfb_timeout=30.0, min_try_timeout=0.05)
        t0 = time.monotonic()
        got, spans = await ask(up)
        took = time.monotonic() - t0
        assert isinstance(got, Opened) and got.replica.url == B
        assert 0.2 <= took < 1.0  # the chat bucket's TTFT target, 200 ms, then B answers at once
        assert up.pool.abandoned == [A] and spans[0]["outcome"] == "try_timeout"
        a = up.replicas.replicas[A]
        assert a.ready and a.fails == 1 and a.inflight == 0  # slow is not dead: it stays in rotation
    asyncio.run(go())


def test_the_last_try_waits_out_the_whole_budget_then_answers_504():
    async def go():
        up = upstream({A: [HANG]}, ttfb_timeout=0.6, min_try_timeout=0.05)
        t0 = time.monotonic()
        got, _ = await ask(up)
        assert isinstance(got, Failed) and got.status == 504 and time.monotonic() - t0 >= 0.55
        assert json.loads(got.body)["error"]["type"] == "gateway_timeout"
    asyncio.run(go())


def test_every_replica_hanging_ends_within_the_time_to_first_byte_budget():
    async def go():
        up = upstream({A: [HANG], B: [HANG], C: [HANG]}, ttfb_timeout=0.8, min_try_timeout=0.05)
        t0 = time.monotonic()
        got, spans = await ask(up)
        assert isinstance(got, Failed) and got.status == 504 and time.monotonic() - t0 < 1.2
        assert [s["outcome"] for s in spans] == ["try_timeout", "try_timeout", "timeout"]
        assert sorted(up.pool.abandoned) == [A, B, C]
    asyncio.run(go())


def test_try_limit_is_the_buckets_ttft_target_within_bounds():
    assert try_limit(CHAT, 1.0, 30.0) == 1.0  # 200 ms target, raised to the floor
    assert try_limit(RoutedBucket.model_validate({"name": "doc", "slo": {"ttftMs": 5000}}), 1.0, 30.0) == 5.0
    assert try_limit(RoutedBucket(name="any"), 1.0, 30.0) == 30.0  # no target: the cap


def test_the_retry_budget_delays_retries_past_its_share_and_drops_none():
    async def go():
        budget = RetryBudget(percent=10.0, floor=1, active=10)
        assert budget.room() and await budget.acquire(time.monotonic() + 1)
        assert not budget.room()  # 1 of 10 in flight: 10 % and the floor both reached
        waiter = asyncio.create_task(budget.acquire(time.monotonic() + 5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        budget.release()
        assert await waiter and budget.retrying == 1
        budget.active = 40  # four retries allowed at 40 in flight
        assert all([await budget.acquire(time.monotonic()) for _ in range(3)]) and not budget.room()
        assert not await budget.acquire(time.monotonic() + 0.05)  # none came before its deadline
    asyncio.run(go())


def test_requests_failing_together_all_succeed_one_retry_at_a_time_under_a_floor_of_one():
    async def go():
        up = upstream({A: [(0.05, ConnectionResetError("killed"))], B: [(0.1, Answer(200, OK))]},
                      retry_budget_floor=1, retry_budget_percent=0.0)
        up.balancer = Balancer("least-load")  # all go to A first: B's load is made higher
        up.replicas.replicas[B].waiting = 100
        got = await asyncio.gather(*(ask(up) for _ in range(5)))
        assert all(isinstance(g, Opened) and g.replica.url == B for g, _ in got)
        assert up.pool.most == {A: 5, B: 1}  # five failed together; their retries went one by one
        assert up.budget.retrying == 0 and value(up, "failovers") == 5 and value(up, "retries") == 5
    asyncio.run(go())


def test_a_prefill_replica_dying_mid_handoff_lets_the_decode_replica_prefill_itself():
    async def go():
        lost = Answer(502, b'{"error": {"message": "prefill engine http://p:1 unreachable: ReadError"}}')
        up = upstream({B: [lost, Answer(200, OK)], A: [Answer(200, OK)]}, roles={B: DECODE, A: PREFILL},
                      prefill_threshold_tokens=100)
        got, spans = await ask(up, tokens=500)
        assert isinstance(got, Opened) and got.replica.url == B
        assert up.pool.asked == [(B, A), (B, None)]  # the same decode replica, now without a prefill replica
        assert not up.replicas.replicas[A].ready and spans[1]["route"] == "fallback"
    asyncio.run(go())


def test_a_decode_replica_dying_before_its_first_token_is_retried_from_the_prompt():
    async def go():
        up = upstream({B: [ConnectionResetError("killed")], C: [Answer(200, OK)], A: [Answer(200, OK)]},
                      roles={B: DECODE, C: DECODE, A: PREFILL}, prefill_threshold_tokens=100)
        got, _ = await ask(up, tokens=500)
        assert isinstance(got, Opened)
        tried = [u for u, _ in up.pool.asked]
        assert tried[-1] == got.replica.url and B in tried and got.replica.url != B
        assert all(p == A for _, p in up.pool.asked)  # each try hands the prompt to the prefill replica again
    asyncio.run(go())


def test_a_replica_failing_in_a_row_is_ejected_until_its_time_is_served():
    async def go():
        rs = ReplicaSet(static={A: UNIFIED, B: UNIFIED, C: UNIFIED}, eject_seconds=0.3)
        a, b = rs.replicas[A], rs.replicas[B]
        b.ready = True  # C is down, not ejected
        for _ in range(3):
            rs.failed(a, "refused")
        assert rs.ejected(a) and a.ejections == 1
        for _ in range(3):
            rs.failed(b, "no first byte", out=False)
        assert not rs.ejected(b) and b.ready  # the last one ready and not ejected: slow, it stays in rotation
        probe = Prober()
        await rs.probe(probe, a)
        assert not a.ready  # its probe answers, but its ejection is not over
        await asyncio.sleep(0.35)
        await rs.probe(probe, a)
        assert a.ready
        for _ in range(3):
            rs.failed(a, "refused")
        assert a.ejections == 2 and a.ejected_until - time.monotonic() > 0.5  # twice as long the second time
        rs.answered(a)
        assert a.fails == 0 and a.ejections == 0
    asyncio.run(go())


class Prober:
    """An aiohttp session stand-in whose every GET answers 200 with an empty body."""

    def get(self, url: str):
        return Reply()


class Reply:
    status = 200

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def text(self) -> str:
        return ""

    async def json(self, content_type=None) -> dict:
        return {"data": [{"max_model_len": 2048}]}



def test_a_request_whose_every_replica_died_waits_for_one_to_come_back():
    async def go():
        up = upstream({A: [ConnectionResetError("killed"), Answer(200, OK)]}, hold_timeout=5.0)
        a = up.replicas.replicas[A]

        async def restart():  # its probe sees it back
            await asyncio.sleep(0.2)
            a.ready = True
            up.replicas.became_ready.set()
        back = asyncio.create_task(restart())
        got, spans = await ask(up)
        await back
        assert isinstance(got, Opened) and got.replica.url == A and [s["outcome"] for s in spans[:1]] == ["failed"]
    asyncio.run(go())


def test_a_stream_that_errs_before_its_first_token_is_retried_elsewhere():
    cut = Answer(200, b'data: {"error": {"message": "the server shut down", "type": "server_error", "code": 500}}'
                      b'\n\n')

    async def go():
        up = upstream({A: [cut], B: [Answer(200, OK)]})
        got, spans = await ask(up)
        assert isinstance(got, Opened) and got.replica.url == B and spans[0]["outcome"] == "error_before_token"
        up = upstream({A: [cut]}, hold_timeout=0.2)
        got, _ = await ask(up)  # nowhere else, nor back soon: the engine's error, as a status the client sees
        assert isinstance(got, Failed) and got.status == 500 and b"shut down" in got.body
    asyncio.run(go())


def test_when_the_other_replica_dies_a_slow_one_gets_the_last_try_with_the_whole_budget():
    async def go():
        up = upstream({A: [HANG, (0.3, Answer(200, OK))], B: [ConnectionRefusedError("dead")]},
                      min_try_timeout=0.05, ttfb_timeout=5.0)
        got, spans = await ask(up)
        assert isinstance(got, Opened) and got.replica.url == A
        assert [(s["replica"], s["outcome"] if "outcome" in s else "answered") for s in spans] == [
            (A, "try_timeout"), (B, "failed"), (A, "answered")]
    asyncio.run(go())


def test_an_error_event_after_a_chat_streams_role_event_is_still_before_its_first_token():
    role = b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
    error = b'data: {"error": {"message": "shut down", "code": 503}}\n\n'
    got = early_error(role + error)
    assert got is not None and got.status == 503 and json.loads(got.body)["error"]["message"] == "shut down"
    assert early_error(error).status == 503
    assert early_error(role + b'data: {"error": {"message": "bad", "code": 400}}\n\n') is None  # not a fault
    assert early_error(role + b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n') is None


def test_tries_on_a_fleet_that_is_all_down_do_not_use_up_the_request():
    async def go():
        up = upstream({A: [ConnectionResetError("killed"), Answer(200, OK)], B: [ConnectionResetError("killed")]},
                      max_attempts=2, hold_timeout=5.0)
        up.balancer = Balancer("least-load")
        up.replicas.replicas[B].waiting = 1  # A first, then B

        async def restart():  # both died; A's probe sees it back
            while up.replicas.ready(UNIFIED):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            up.replicas.replicas[A].ready = True
            up.replicas.became_ready.set()
        back = asyncio.create_task(restart())
        got, spans = await ask(up)
        await back
        assert isinstance(got, Opened) and got.replica.url == A
        assert [s["replica"] for s in spans] == [A, B, A]  # a third try under max_attempts=2: B's found none up
    asyncio.run(go())
