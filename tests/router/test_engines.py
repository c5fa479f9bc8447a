"""The router in front of two real `slofleet serve` engines on loopback: streaming through the openai client,
clear auth/quota errors, prefix affinity, shedding by priority, and a replica killed mid-load."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.support.router import RouterProc
from tests.support.server import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# one torch thread each: two engines on two cores must not oversubscribe them (OpenMP spinning then crawls)
ENGINE_FLAGS = ("--max-num-seqs", "2", "--num-blocks", "256", "--max-waiting-requests", "64", "--num-threads", "1")
DOC = ("The harbor of the old town had three piers, a lighthouse painted red and white, and a market that opened "
       "before dawn where fishermen sold the night's catch to cooks from every inn along the coast. ")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("engines")
    servers = [Server(*ENGINE_FLAGS, log=d / f"engine{i}.log") for i in range(2)]
    try:
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory):
    d = tmp_path_factory.mktemp("router")
    (d / "keys").write_text("sk-test\nsk-slow rpm=1\n")
    r = RouterProc(*[f for s in engines for f in ("--upstream", s.url)], "--api-keys-file", str(d / "keys"),
                   log=d / "router.log").wait_ready()
    while len([v for k, v in r.metrics().items() if "replica_ready" in k and v == 1]) < 2:
        time.sleep(0.1)
    yield r
    r.stop()


def completion(router, prompt: str, max_tokens: int = 4, key: str = "sk-test", body: dict | None = None,
               **headers) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            **(body or {})}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}", **headers})


def test_streams_end_to_end_with_the_openai_client(router, engines):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-test")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=6, temperature=0, stream=True)
    via_router = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    direct = openai.OpenAI(base_url=engines[0].url + "/v1", api_key="x").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, temperature=0)
    assert via_router == direct.choices[0].message.content and via_router
    assert [m.id for m in client.models.list()] == [MODEL]


def test_auth_and_quota_errors_are_clear(router):
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        openai.OpenAI(base_url=router.url + "/v1", api_key="sk-nope", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=1)
    slow = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-slow", max_retries=0)
    slow.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError, match="1 requests per minute") as e:
        slow.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert int(e.value.response.headers["retry-after"]) >= 1
    bad = httpx.post(router.url + "/v1/completions", json={"model": "other", "prompt": "hi"},
                     headers={"authorization": "Bearer sk-test"}, timeout=30)
    assert bad.status_code == 400 and "not served here" in bad.json()["error"]["message"]  # engine errors pass


def test_prefix_affinity_sends_same_prefix_to_same_replica(router, engines):
    hits_before = sum(s.metrics()["vllm:prefix_cache_hits_total{}"] for s in engines)
    chosen: dict[int, set[str]] = {0: set(), 1: set()}
    for i in range(3):
        for doc in (0, 1):
            r = completion(router, f"Document {doc}. " + DOC * 3 + f" Question {i}: what is on pier {i}?", 1)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            chosen[doc].add(r.headers["x-slofleet-replica"])
    assert len(chosen[0]) == 1 and len(chosen[1]) == 1, chosen
    hits = sum(s.metrics()["vllm:prefix_cache_hits_total{}"] for s in engines) - hits_before
    assert hits >= 4 * 64, f"each repeat should reuse the shared document's blocks, got {hits} hit tokens"


def test_shedding_follows_priority(engines, tmp_path):
    """Capacity 2 per replica (4 in all): the critical bucket may fill it, the sheddable one only half."""
    (tmp_path / "b.json").write_text(json.dumps([
        {"name": "batch", "priority": 8, "match": {"header": {"x-tier": "batch"}}, "slo": {"e2eMs": 600000}},
        {"name": "chat", "priority": 0, "slo": {"ttftMs": 1000}}]))
    r = RouterProc(*[f for s in engines for f in ("--upstream", s.url)], "--buckets", str(tmp_path / "b.json"),
                   "--capacity-per-replica", "2", log=tmp_path / "router.log").wait_ready()
    try:
        codes: list[tuple[str, int]] = []

        def inflight() -> float:
            return sum(v for k, v in r.metrics().items() if k.startswith("slofleet:router_inflight_requests"))

        def fire(bucket: str) -> threading.Thread:
            before = len(codes) + inflight()
            headers = {"x-tier": "batch"} if bucket == "batch" else {}
            t = threading.Thread(target=lambda: codes.append(
                # 256 tokens, EOS ignored: each admitted request holds its slot for seconds, far longer than firing
                # all six takes however fast the engine decodes (32 tokens once ended before the last was fired)
                (bucket, completion(r, "Count slowly: one two", 256, body={"ignore_eos": True},
                                    **headers).status_code)))
            t.start()
            while len(codes) + inflight() == before:  # admitted (in flight) or refused: then the next one
                time.sleep(0.01)
            return t

        threads = [fire("batch"), fire("batch"), fire("batch"), fire("chat"), fire("chat"), fire("chat")]
        for t in threads:
            t.join()
        assert sorted(codes) == sorted([("batch", 200), ("batch", 200), ("batch", 429),
                                        ("chat", 200), ("chat", 200), ("chat", 429)]), codes
        m = r.metrics()
        assert m["slofleet:router_rejected_total{bucket=batch,reason=shed}"] == 1
    finally:
        r.stop()


def test_killing_a_replica_mid_load_loses_no_unstarted_request(router, engines):
    """Runs last in the module: it kills engine 1. Engines run 2 requests at a time, so most of this load waits
    in the victim's queue when it dies; those must be retried on the survivor. Non-streaming requests send no
    byte before they finish, so every one of them must complete."""
    victim = engines[1]
    results: list[dict] = []
    first_bytes = "slofleet:router_time_to_first_byte_seconds_count{bucket=default}"
    ttfb0 = router.metrics().get(first_bytes, 0)  # absent until the first request

    def one(i: int, stream: bool) -> None:
        out = {"replica": None, "done": False, "status": None, "stream": stream}
        body = {"model": MODEL, "prompt": f"Request {i}: list some colours", "max_tokens": 8, "ignore_eos": True,
                "temperature": 0, "stream": stream}
        try:
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=180,
                              headers={"authorization": "Bearer sk-test"}) as resp:
                out["status"], out["replica"] = resp.status_code, resp.headers.get("x-slofleet-replica")
                if stream:
                    out["done"] = any(line == "data: [DONE]" for line in resp.iter_lines())
                else:
                    out["done"] = json.loads(resp.read())["usage"]["completion_tokens"] == 8
        except httpx.HTTPError as e:
            out["error"] = repr(e)
        results.append(out)

    threads = [threading.Thread(target=one, args=(i, i % 3 != 2)) for i in range(12)]
    for t in threads:
        t.start()
    while not results and router.metrics().get(first_bytes, 0) < ttfb0 + 1:
        time.sleep(0.05)  # kill once the fleet is busy: some streams started, others still queued
    victim.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    while router.metrics()[f"slofleet:router_replica_ready{{replica={victim.url}}}"] != 0:
        time.sleep(0.1)
    assert time.monotonic() - killed_at < 5, "a dead replica must leave the rotation within seconds"
    for t in threads:
        t.join()
    lost = [r for r in results if not r["done"]]
    assert all(r["replica"] == victim.url and r["stream"] for r in lost), \
        f"only streams started on the victim may break: {lost}"
    assert sum(not r["stream"] for r in results) == 4
    assert all(r["status"] == 200 for r in results if r["replica"] != victim.url), results
    assert len(lost) <= 2, f"at most the victim's 2 running requests had started streaming: {lost}"
    assert router.metrics()["slofleet:router_retries_total{bucket=default}"] >= 1
