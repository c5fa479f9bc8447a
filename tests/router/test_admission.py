"""SLO-aware admission (router/predict.py, buckets.Classifier): the predictor on its own, then one replica driven
past its knee through a real router. The replica is a stand-in whose timing is set here (prompts prefilled one at
a time in priority order at a fixed rate), so that where the knee lies is known and the checks are ratios."""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass

import httpx
import pytest

from slofleet.router.buckets import Admission, Classifier, parse_buckets
from slofleet.router.predict import Predictor, Rates
from tests.support.router import RouterProc
from tests.support.server import serve_in_thread

# -- the predictor and the classifier, alone -----------------------------------------------------------------


def test_prediction_counts_only_work_at_its_priority_or_higher():
    p = Predictor(Rates(prefill_tps=1000, step_s=0.01, window_s=5.0))
    p.claim("a", 500, 5, now=0.0)
    p.claim("a", 200, 0, now=0.0)
    hi, lo = p.predict("a", 100, 0, 0.0), p.predict("a", 100, 5, 0.0)
    assert hi.ahead == 200 and lo.ahead == 700
    assert hi.ttft_s == pytest.approx(0.01 + 0.3)
    # the 200 high-priority tokens just sent (40 tokens/s over the 5 s window) will also go before it: 4% busy
    assert lo.ttft_s == pytest.approx((0.01 + 0.8) / (1 - 0.04))
    assert p.predict("a", 100, 5, 100.0).ttft_s == pytest.approx(0.81, rel=1e-3)  # those arrivals long past
    assert p.predict("b", 100, 5, 0.0).first  # another replica: nothing ahead there


def test_first_bytes_teach_the_prefill_rate_and_a_higher_priority_counts_as_ahead():
    p = Predictor(Rates(prefill_tps=100_000, step_s=0.0, alpha=0.5))
    lo = p.claim("a", 1000, 5, now=0.0)
    hi = p.claim("a", 1000, 0, now=0.0)  # sent later, served first: the low one waits for 2000 tokens
    p.first_byte(hi, now=1.0)
    assert p.clocks["a"].prefill_s_per_token == pytest.approx(1e-3)  # the first sample replaces the prior
    p.first_byte(lo, now=2.0)
    assert p.clocks["a"].prefill_s_per_token == pytest.approx(1e-3)  # 2 s for 2000 tokens: the same rate
    assert p.predict("a", 500, 0, 9.0).ttft_s == pytest.approx(0.5)
    p.first_byte(lo, now=9.0)  # a second report of the same claim teaches nothing
    assert p.clocks["a"].prefill_s_per_token == pytest.approx(1e-3)


def test_streams_teach_the_step_and_failures_teach_nothing():
    p = Predictor(Rates(prefill_tps=1000, step_s=0.5))
    c = p.claim("a", 100, 0, now=0.0)
    p.release(c)  # failed: nothing learned, nothing left pending
    assert p.clocks["a"].prefill_samples == 0 and p.ahead("a", 9) == 0
    p.streamed("a", 11, 1.0)
    assert p.clocks["a"].step_s == pytest.approx(0.1)
    p.keep(["b"])
    assert "a" not in p.clocks


BUCKETS = [{"name": "hi", "priority": 0, "match": {"header": {"x-tier": "hi"}}, "slo": {"ttftMs": 400}},
           {"name": "lo", "priority": 5, "slo": {"ttftMs": 1200}},
           {"name": "free", "priority": 5, "match": {"header": {"x-tier": "free"}}, "slo": {"ttftMs": 100},
            "admission": {"mode": "off"}},
           {"name": "fixed", "priority": 5, "match": {"header": {"x-tier": "fixed"}}, "slo": {"ttftMs": 100},
            "admission": {"mode": "fixed", "maxWaitingRequests": 1}}]


def test_modes_decide_who_the_prediction_refuses():
    c = Classifier(parse_buckets(BUCKETS), predictor=Predictor(Rates(prefill_tps=1000, step_s=0.0)))
    hi, lo, free, fixed = c.buckets[:4]
    assert [b.admission_mode() for b in (hi, lo, free, fixed)] == ["slo-predicted", "slo-predicted", "off", "fixed"]
    c.admit(lo, 1000, 0, 100, "a")  # nothing ahead: admitted, however long
    c.admit(hi, 300, 0, 100, "a")  # the low one's 1000 tokens are not ahead of it: 0.3 s < 0.4 s
    with pytest.raises(Admission) as e:
        c.admit(hi, 200, 0, 100, "a")  # 500 tokens: 0.5 s
    assert e.value.reason == "predicted_ttft" and "'hi'" in str(e.value) and e.value.retry_after >= 1
    with pytest.raises(Admission):
        c.admit(lo, 10, 0, 100, "a")  # behind 1300 tokens: 1.31 s > 1.2 s
    for _ in range(3):
        c.admit(free, 5000, 0, 100, "a")  # off: never refused
    c.admit(fixed, 5000, 0, 100, "a")  # fixed: its own limit, no prediction
    with pytest.raises(Admission) as e:
        c.admit(fixed, 1, 0, 100, "a")
    assert e.value.reason == "waiting"


def test_a_ticket_released_at_its_first_byte_frees_its_tokens():
    c = Classifier(parse_buckets(BUCKETS), predictor=Predictor(Rates(prefill_tps=1000, step_s=0.0)))
    hi = c.buckets[0]
    t = c.admit(hi, 300, 0, 100, "a")
    c.release(t, "a")
    c.release(t, "a")
    assert c.predictor.ahead("a", 0) == 0 and c.predictor.clocks["a"].prefill_samples == 1
    c.admit(hi, 300, 0, 100, "a")


def test_the_balancer_previews_its_choice_without_taking_a_turn():
    from slofleet.router.balancer import Balancer, prefix_key
    from slofleet.router.replicas import Replica

    ready = [Replica(f"http://r{i}", ready=True) for i in range(3)]
    rr = Balancer("round-robin")
    assert [rr.preview(ready, None).url for _ in range(3)] == ["http://r0"] * 3
    assert rr.choose(ready, None, set()).url == "http://r0" and rr.preview(ready, None).url == "http://r1"
    hashing = Balancer("prefix")
    hashing.set_urls([r.url for r in ready])
    key = prefix_key("x" * 300, 256)
    assert hashing.preview(ready, key) is hashing.choose(ready, key, set())
    ready[0].inflight = 5
    assert hashing.preview(ready, None) is not ready[0]  # no key: the least loaded
    assert Balancer("least-load").preview([], None) is None


# -- one replica past its knee -----------------------------------------------------------------------------------

PREFILL_TPS = 2000.0  # the stand-in's prefill: hi prompts take 50 ms, lo prompts 200 ms
STEP_S, OUTPUT = 0.02, 5
HI_TOKENS, LO_TOKENS = 100, 400


class QueueEngine:
    """A stand-in engine (not the real one) that queues: it prefills one prompt at a time, the lowest priority
    number first, at PREFILL_TPS (a prompt's tokens estimated as the router does, 4 characters each), then streams
    OUTPUT tokens STEP_S apart."""

    def __init__(self) -> None:
        self.queue: asyncio.PriorityQueue | None = None
        self.order = itertools.count()
        self.server, self.thread, self.url = serve_in_thread(self.app)

    async def prefill(self) -> None:
        while True:
            _, _, tokens, done = await self.queue.get()
            await asyncio.sleep(tokens / PREFILL_TPS)
            done.set()

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] in ("/ready", "/health", "/metrics", "/v1/models"):
            await send({"type": "http.response.start", "status": 200 if scope["path"] != "/v1/models" else 404,
                        "headers": []})
            return await send({"type": "http.response.body", "body": b"ok" if scope["path"] != "/metrics" else b""})
        raw, more = b"", True
        while more:
            msg = await receive()
            raw, more = raw + msg.get("body", b""), msg.get("more_body", False)
        request = json.loads(raw)
        if self.queue is None:
            self.queue = asyncio.PriorityQueue()
            asyncio.get_running_loop().create_task(self.prefill())
        done = asyncio.Event()
        await self.queue.put((request.get("priority", 0), next(self.order), len(request["prompt"]) // 4 + 1, done))
        await done.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        token = b'data: {"choices":[{"text":"x"}]}\n\n'
        for _ in range(OUTPUT):
            await send({"type": "http.response.body", "body": token, "more_body": True})
            await asyncio.sleep(STEP_S)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@dataclass(slots=True)
class Outcome:
    bucket: str
    status: int
    seconds: float  # to the first byte (admitted) or to the refusal
    retry_after: str | None = None
    body: str = ""
    complete: bool = False


async def one(client: httpx.AsyncClient, url: str, bucket: str, i: int) -> Outcome:
    tokens = HI_TOKENS if bucket == "hi" else LO_TOKENS
    prompt = f"{i:06d} " + "word " * ((tokens - 1) * 4 // 5)
    body = {"model": "m", "prompt": prompt[:tokens * 4 - 4], "max_tokens": OUTPUT, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"x-tier": bucket} if bucket == "hi" else {}) as r:
        first = None
        chunks = []
        async for chunk in r.aiter_bytes():
            first = first or time.perf_counter() - t0
            chunks.append(chunk)
        text = b"".join(chunks).decode()
        return Outcome(bucket, r.status_code, first or time.perf_counter() - t0, r.headers.get("retry-after"), text,
                       text.rstrip().endswith("data: [DONE]"))


async def drive(url: str, rate: float, seconds: float) -> list[Outcome]:
    """Open loop: hi and lo alternate, evenly spaced at `rate` requests per second."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        tasks, t0 = [], time.perf_counter()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, url, "hi" if i % 2 else "lo", i)))
        return await asyncio.gather(*tasks)


@pytest.fixture(scope="module")
def engine():
    e = QueueEngine()
    yield e
    e.stop()


def test_past_the_knee_lower_priority_is_refused_first_and_admitted_meet_targets(engine, tmp_path):
    """The replica serves 8 requests/s of this half-and-half mix (125 ms of prefill each on average): driven at
    3x that, it must refuse, refuse the low priority more, and keep what it admits within target."""
    (tmp_path / "b.json").write_text(json.dumps({"buckets": BUCKETS[:2]}))
    r = RouterProc("--upstream", engine.url, "--buckets", str(tmp_path / "b.json"),
                   log=tmp_path / "router.log").wait_ready()
    try:
        knee = 1 / ((HI_TOKENS + LO_TOKENS) / 2 / PREFILL_TPS)
        asyncio.run(drive(r.url, knee / 2, 2.0))  # warm-up under the knee: the router learns the replica's rates
        out = asyncio.run(drive(r.url, 3 * knee, 5.0))
        m = r.metrics()
    finally:
        r.stop()
    by = {b: [o for o in out if o.bucket == b] for b in ("hi", "lo")}
    refused = {b: [o for o in v if o.status == 429] for b, v in by.items()}
    admitted = {b: [o for o in v if o.status != 429] for b, v in by.items()}
    share = {b: len(refused[b]) / len(by[b]) for b in by}
    assert share["lo"] > 0.3, share  # refusals happen
    assert share["hi"] < share["lo"] / 2, share  # the low priority is refused first
    assert all(o.status == 200 and o.complete for v in admitted.values() for o in v)  # no admitted request fails
    target = {"hi": 0.4, "lo": 1.2}
    within = {b: sum(o.seconds <= target[b] for o in admitted[b]) / max(1, len(admitted[b])) for b in by}
    # the high priority's admitted keep their target; the low one's may yield some of theirs to later high ones
    assert within["hi"] >= 0.95 and within["lo"] >= 0.6, within
    for o in refused["lo"] + refused["hi"]:
        assert o.retry_after and int(o.retry_after) >= 1
        assert f"'{o.bucket}'" in json.loads(o.body)["error"]["message"]
    waits = sorted(o.seconds for v in refused.values() for o in v)
    assert waits[int(0.99 * (len(waits) - 1))] < target["hi"] / 4  # refused at once, not after a wait
    assert m["slofleet:router_refused_total{bucket=lo,reason=predicted_ttft}"] == len(refused["lo"])
    assert m["slofleet:router_admitted_total{bucket=hi,mode=slo-predicted}"] >= len(admitted["hi"])
