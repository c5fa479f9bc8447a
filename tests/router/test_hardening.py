"""No request, header or payload crashes, bypasses or poisons the router (issue #11): read timeouts toward the
engine, streams cut mid-way, the fields quotas charge, the keys file, slow clients, and draining on SIGTERM."""
from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from slofleet.router.gateway import GatewayError, KeyStore
from tests.support import ROOT
from tests.support.router import RouterProc

from .helpers import StandIn

KEYS = "sk-free\nsk-ctx tpm=1000\nsk-cpl tpm=1000\n"


def chat(text: str = "hello", **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True, **extra}


@pytest.fixture(scope="module")
def standin():
    s = StandIn()
    s.max_model_len = 600
    yield s
    s.stop()


@pytest.fixture(scope="module")
def router(standin, tmp_path_factory):
    d = tmp_path_factory.mktemp("hard")
    (d / "keys").write_text(KEYS)
    r = RouterProc("--upstream", standin.url, "--api-keys-file", str(d / "keys"), "--upstream-ttfb-timeout", "1",
                   "--upstream-idle-timeout", "1", "--body-timeout", "1", "--header-timeout", "1",
                   "--max-header-bytes", "8192", log=d / "router.log").wait_ready()
    yield r
    r.stop()


@pytest.fixture
def engine(router, standin):
    """The stand-in back to its defaults, and back in the router's rotation, after each test."""
    yield standin
    standin.delay, standin.stall, standin.cut = 0.0, 0.0, False
    router.wait_ready(10)


def post(router, body: dict, key: str = "sk-free", path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(router.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def events(router, body: dict) -> tuple[list[str], float]:
    """The data lines of a streamed answer, and the seconds it took."""
    t0 = time.monotonic()
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body,
                      headers={"authorization": "Bearer sk-free"}, timeout=30) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    return lines, time.monotonic() - t0


def test_max_tokens_must_be_an_integer_of_at_least_one(router, engine):
    """A negative max_tokens used to refill the key's token bucket."""
    for field, value in (("max_tokens", -1000), ("max_completion_tokens", 0), ("max_tokens", 2.5),
                         ("max_tokens", "9"), ("max_tokens", True)):
        r = post(router, chat(**{field: value}), key="sk-ctx")
        assert r.status_code == 400, (field, value, r.text)
        assert field in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
    assert post(router, chat(max_tokens=5), key="sk-free").status_code == 200


def test_without_max_tokens_a_request_is_charged_for_what_the_engine_may_generate(router, engine):
    """The replica lists max_model_len 600: a chat without max_tokens may generate ~600 tokens, so a key with
    1,000 tokens a minute has room for one (a flat 256 let three through); a completion, 16 by default."""
    assert post(router, chat(), key="sk-ctx").status_code == 200
    r = post(router, chat(), key="sk-ctx")
    assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]
    for _ in range(5):
        assert post(router, {"model": "m", "prompt": "hi"}, key="sk-cpl", path="/v1/completions").status_code == 200


def test_no_first_byte_in_time_is_a_504_and_aborts_the_engine_request(router, engine):
    engine.delay, aborted = 5.0, engine.aborted
    t0 = time.monotonic()
    r = post(router, chat())
    assert r.status_code == 504 and time.monotonic() - t0 < 4
    assert r.json()["error"]["code"] == 504 and "within 1 s" in r.json()["error"]["message"]
    deadline = time.monotonic() + 5
    while engine.aborted == aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.aborted == aborted + 1
    assert router.metrics()["slofleet:router_rejected_total{bucket=default,reason=timeout}"] >= 1


def test_a_stream_that_goes_quiet_ends_with_an_error_event(router, engine):
    lines, took = events(router, chat(stall=5))
    assert took < 4 and len(lines) == 3 and lines[2] == "[DONE]"  # the error, then the stream's usual end
    error = json.loads(lines[1])["error"]
    assert error["code"] == 504 and "nothing for 1 s" in error["message"]


def test_a_replica_failing_mid_stream_ends_it_with_an_error_event(router, engine):
    engine.cut = True
    lines, _ = events(router, chat())
    assert len(lines) == 3 and json.loads(lines[0])["port"] == engine.port and lines[2] == "[DONE]"
    assert json.loads(lines[1])["error"]["code"] == 502
    m = router.metrics()
    assert m["slofleet:router_streams_cut_total{bucket=default,reason=replica_failed}"] >= 1


def closes_within(router, head: bytes, trickle: bool = False, limit: float = 8.0) -> float:
    """Seconds until the router closes a connection that sent `head` (then a byte every 0.2 s with `trickle`)."""
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        t0 = time.monotonic()
        try:
            s.sendall(head)
            s.settimeout(0.2)
            while time.monotonic() - t0 < limit:
                try:
                    if s.recv(65536) == b"":
                        break
                except TimeoutError:
                    if trickle:
                        s.sendall(b"x")
        except (BrokenPipeError, ConnectionResetError):
            pass
        return time.monotonic() - t0


def test_slow_or_huge_request_heads_and_slow_bodies_are_cut(router, engine):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    assert closes_within(router, b"") < 3  # connects, sends nothing
    assert closes_within(router, head + b"X-Slow: ", trickle=True) < 3  # slowloris: a header byte at a time
    assert closes_within(router, head + b"X-Big: " + b"a" * 20000) < 3
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
        s.sendall(head + b"Authorization: Bearer sk-free\r\nContent-Length: 1000\r\n\r\n{")
        answer = b""
        while b"}}" not in answer and (chunk := s.recv(65536)):  # up to the end of the error body
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer
    assert post(router, chat()).status_code == 200  # everyone else is served meanwhile


def test_a_malformed_keys_file_is_logged_and_the_old_keys_stay(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("sk-old rpm=5\n")
    store = KeyStore(str(path), None)
    bearer = lambda key: {"authorization": f"Bearer {key}"}  # noqa: E731
    for n, bad in enumerate([b"sk-new rpm=lots\n", b"sk-new rmp=5\n", b"sk-new sk-other\n", b"sk-new\n\xff\n"]):
        path.write_bytes(bad)
        os.utime(path, (1000 + n, 1000 + n))
        with caplog.at_level(logging.ERROR, "slofleet.router.gateway"):
            store.reload()  # a malformed file used to raise here, out of the reload loop, which then stopped
        assert store.authenticate(bearer("sk-old")) is not None
        with pytest.raises(GatewayError):
            store.authenticate(bearer("sk-new"))
    assert caplog.text.count("not reloaded") == 4 and "line 1" in caplog.text
    assert "sk-" not in caplog.text  # the keys are secrets: never logged
    path.unlink()  # a Secret's files are swapped, not edited: briefly missing is no reason to drop every key
    store.reload()
    assert store.authenticate(bearer("sk-old")) is not None
    path.write_text("sk-new\n")
    store.reload()
    assert store.authenticate(bearer("sk-new")) is not None
    with pytest.raises(GatewayError):
        store.authenticate(bearer("sk-old"))
    # At start, a malformed file stops the router with the reason.
    path.write_text("sk-a rpm=-1\n")
    out = subprocess.run([sys.executable, "-m", "slofleet.cli", "router", "--upstream", "http://127.0.0.1:9",
                          "--api-keys-file", str(path)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "line 1: rpm and tpm must be >= 0" in out.stderr


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch):
    monkeypatch.setenv("KEYS", "sk-a,sk-b,sk-c")
    store = KeyStore(None, "KEYS")
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for key in ("sk-a", "sk-c", "sk-zzzz"):
        calls.clear()
        try:
            store.authenticate({"authorization": f"Bearer {key}"})
        except GatewayError:
            assert key == "sk-zzzz"
        assert len(calls) == 3, key  # no early exit at the match, none on a miss


def test_sigterm_drains_then_exits(tmp_path):
    """/ready and new requests answer 503 at once; a stream that ends within the grace period ends normally, one
    that does not is cut with an error event; then the process exits."""
    engine = StandIn(delay=2.0)
    r = RouterProc("--upstream", engine.url, "--drain-delay", "1", "--grace-period", "3",
                   log=tmp_path / "router.log").wait_ready()
    results: dict[str, list[str]] = {}

    def stream(name: str, **extra) -> None:
        with httpx.stream("POST", r.url + "/v1/chat/completions", json=chat(**extra), timeout=30) as resp:
            results[name] = [line for line in resp.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=stream, args=("finishes",)),
               threading.Thread(target=stream, args=("cut",), kwargs={"stall": 30})]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)  # both in flight, waiting for their first byte
        r.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        ready = httpx.get(r.url + "/ready", timeout=5)
        assert ready.status_code == 503 and ready.text == "draining"
        new = httpx.post(r.url + "/v1/chat/completions", json=chat(), timeout=5)
        assert new.status_code == 503 and new.headers["retry-after"] == "1"
        assert "shutting down" in new.json()["error"]["message"]
        for t in threads:
            t.join(20)
        assert results["finishes"][-1] == "data: [DONE]"
        assert len(results["cut"]) == 3 and results["cut"][2] == "data: [DONE]"
        assert "shutting down" in json.loads(results["cut"][1][6:])["error"]["message"]
        r.proc.wait(10)
        assert 3 < time.monotonic() - t0 < 10  # the drain delay, then the grace period
    finally:
        r.stop()
        engine.stop()
