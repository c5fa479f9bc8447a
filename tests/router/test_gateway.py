"""Gateway, buckets, shedding, retries and disconnects, against stand-in upstreams (fast, no model)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.support.router import RouterProc
from tests.support.server import free_port

from .helpers import StandIn

BUCKETS = {"buckets": [
    {"name": "batch", "priority": 5, "match": {"header": {"x-tier": "batch"}}, "slo": {"ttftMs": 60000}},
    {"name": "chat", "priority": 0, "match": {"maxPromptTokens": 200, "route": "/v1/chat/completions"},
     "slo": {"ttftMs": 500, "tpotMs": 40}},
    {"name": "long", "priority": 3, "match": {"minPromptTokens": 201}, "slo": {"ttftMs": 5000}},
]}


def chat(text: str = "hello", **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True, **extra}


@pytest.fixture(scope="module")
def standin():
    s = StandIn()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def router(standin, tmp_path_factory):
    d = tmp_path_factory.mktemp("gw")
    (d / "keys").write_text("sk-good rpm=3  # limited\nsk-tokens tpm=100\nsk-free name=free\n")
    (d / "buckets.json").write_text(json.dumps(BUCKETS))
    r = RouterProc("--upstream", standin.url, "--api-keys-file", str(d / "keys"), "--buckets", str(d / "buckets.json"),
                   "--max-body-bytes", "20000", log=d / "router.log").wait_ready()
    yield r
    r.stop()


def post(router, body: dict, key: str | None = "sk-free", path: str = "/v1/chat/completions", **headers):
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(router.url + path, json=body, headers=headers, timeout=30)


def test_auth_errors_are_clear(router, standin):
    r = post(router, chat(), key=None)
    assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "authentication_error"
    r = post(router, chat(), key="sk-wrong")
    assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
    r = post(router, chat(), key="sk-free")
    assert r.status_code == 200 and "[DONE]" in r.text
    assert standin.received[-1]["authorization"] is None, "the client's key must not reach the engine"


def test_request_quota_gives_429_with_retry_after(router):
    codes = [post(router, chat(), key="sk-good") for _ in range(4)]
    assert [c.status_code for c in codes] == [200, 200, 200, 429]
    err = codes[-1]
    assert int(err.headers["retry-after"]) >= 1
    assert "3 requests per minute" in err.json()["error"]["message"]
    assert err.json()["error"]["type"] == "rate_limit_exceeded"


def test_token_quota(router):
    r = post(router, chat(max_tokens=500), key="sk-tokens")
    assert r.status_code == 429 and "lower max_tokens" in r.json()["error"]["message"]
    assert post(router, chat(max_tokens=60), key="sk-tokens").status_code == 200
    r = post(router, chat(max_tokens=60), key="sk-tokens")
    assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]


def test_size_limit_413(router):
    r = post(router, chat("x" * 30000))
    assert r.status_code == 413 and "20000 bytes" in r.json()["error"]["message"]


def test_bucket_priority_and_tpot_target_reach_the_engine(router, standin):
    cases = [(chat("short question"), {}, "/v1/chat/completions", ("chat", 0, "40")),
             (chat("short", priority=-10), {"x-tier": "batch"}, "/v1/chat/completions", ("batch", 5, None)),
             (chat("long " * 400), {}, "/v1/chat/completions", ("long", 3, None)),
             ({"model": "m", "prompt": "short", "stream": True}, {}, "/v1/completions", ("default", 5, None))]
    for body, headers, path, (bucket, priority, tpot) in cases:
        r = post(router, body, path=path, **headers, **{"x-slofleet-tpot-ms": "1"})  # a client's claim is dropped
        assert r.status_code == 200, r.text
        assert r.headers["x-slofleet-bucket"] == bucket
        seen = standin.received[-1]
        assert (seen["bucket"], seen["priority"], seen["tpot"]) == (bucket, priority, tpot)


def test_metrics_per_bucket(router):
    m = router.metrics()
    assert m["slofleet:router_requests_total{bucket=chat,code=200}"] >= 1
    assert m["slofleet:router_rejected_total{bucket=-,reason=auth}"] >= 2
    assert m["slofleet:router_rejected_total{bucket=-,reason=size}"] >= 1
    assert m[f"slofleet:router_replica_ready{{replica={router_upstream(router)}}}"] == 1
    assert "slofleet:router_time_to_first_byte_seconds_count{bucket=chat}" in m


def router_upstream(router) -> str:
    return router.proc.args[router.proc.args.index("--upstream") + 1]


def test_shedding_follows_priority(tmp_path):
    """Capacity 4 in flight: the critical bucket may fill it all, the sheddable one only half."""
    slow = StandIn(delay=3.0)
    (tmp_path / "b.json").write_text(json.dumps(BUCKETS))
    r = RouterProc("--upstream", slow.url, "--buckets", str(tmp_path / "b.json"), "--capacity-per-replica", "4",
                   log=tmp_path / "router.log").wait_ready()
    try:
        results: dict[str, int] = {}

        def fire(name: str, headers: dict) -> threading.Thread:
            def go() -> None:
                results[name] = post(r, chat(), key=None, **headers).status_code
            t = threading.Thread(target=go)
            t.start()
            time.sleep(0.3)  # let it be admitted before the next one arrives
            return t

        threads = [fire("batch1", {"x-tier": "batch"}), fire("batch2", {"x-tier": "batch"})]
        assert post(r, chat(), key=None, **{"x-tier": "batch"}).status_code == 429  # 2 in flight: batch is shed
        threads += [fire("chat1", {}), fire("chat2", {})]  # chat still gets in, up to 4
        shed = post(r, chat(), key=None)
        assert shed.status_code == 429 and "over capacity" in shed.json()["error"]["message"]
        assert int(shed.headers["retry-after"]) >= 1
        for t in threads:
            t.join()
        assert results == {"batch1": 200, "batch2": 200, "chat1": 200, "chat2": 200}
        m = r.metrics()
        assert m["slofleet:router_rejected_total{bucket=batch,reason=shed}"] == 1
        assert m["slofleet:router_rejected_total{bucket=chat,reason=shed}"] == 1
    finally:
        r.stop()
        slow.stop()


def test_failure_before_first_byte_is_retried_and_disconnect_aborts(tmp_path):
    good, bad = StandIn(delay=2.0), StandIn()
    bad.crash = True
    dead = "http://127.0.0.1:9"  # nothing listens there
    r = RouterProc("--upstream", good.url, "--upstream", bad.url, "--upstream", dead, "--policy", "round-robin",
                   log=tmp_path / "router.log").wait_ready()
    try:
        good.delay = 0.0
        for _ in range(6):
            resp = post(r, chat(), key=None)
            assert resp.status_code == 200 and resp.headers["x-slofleet-replica"] == good.url
        assert r.metrics().get("slofleet:router_retries_total{bucket=default}", 0) >= 1
        # a client that leaves before the first byte: the upstream request is aborted
        good.delay = 5.0
        with httpx.Client(timeout=30) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post(r.url + "/v1/chat/completions", json=chat(), timeout=0.5)
        deadline = time.monotonic() + 5
        while good.aborted == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert good.aborted == 1
        assert r.metrics()["slofleet:router_inflight_requests{bucket=default}"] == 0
    finally:
        r.stop()
        good.stop()
        bad.stop()


def test_requests_are_held_until_a_replica_comes_up(tmp_path):
    """Scale from zero: the only replica starts 3 s after the request arrives; the request waits for it, counted
    in slofleet:router_held_requests, instead of failing. With nothing coming up, 503 after the hold timeout."""
    port = free_port()
    r = RouterProc("--upstream", f"http://127.0.0.1:{port}", "--hold-timeout-seconds", "30",
                   log=tmp_path / "router.log").wait_ready(path="/health")
    late = None
    try:
        assert r.metrics()["slofleet:router_held_requests{bucket=default}"] == 0
        result: list[httpx.Response] = []
        t = threading.Thread(target=lambda: result.append(post(r, chat(), key=None)))
        t.start()
        deadline = time.monotonic() + 10
        while r.metrics()["slofleet:router_held_requests{bucket=default}"] != 1:
            assert time.monotonic() < deadline, "the request was not held"
            time.sleep(0.1)
        time.sleep(3)
        assert not result, "answered before any replica was up"
        late = StandIn(port=port)
        t.join(30)
        assert result and result[0].status_code == 200 and result[0].headers["x-slofleet-replica"] == late.url
        assert r.metrics()["slofleet:router_held_requests{bucket=default}"] == 0
    finally:
        r.stop()
        if late:
            late.stop()
    r = RouterProc("--upstream", "http://127.0.0.1:9", "--hold-timeout-seconds", "1",
                   log=tmp_path / "router2.log").wait_ready(path="/health")
    try:
        t0 = time.monotonic()
        resp = post(r, chat(), key=None)
        assert resp.status_code == 503 and 1 <= time.monotonic() - t0 < 10
        assert "came up within 1 s" in resp.json()["error"]["message"]
    finally:
        r.stop()
