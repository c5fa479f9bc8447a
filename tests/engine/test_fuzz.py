"""Fuzz the OpenAI endpoints of a real `slofleet serve`: seeded random bodies (every field of both endpoints given
random types and values, broken JSON, oversized and deeply nested bodies, odd unicode, streaming or not), then
check that nothing answered 5xx or failed in transport, every stream ended properly, and the engine is unharmed."""
from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import time

import httpx
import pytest

from slofleet.api.contract import INTERNAL_TOKEN_ENV
from tests.support.router import RouterProc
from tests.support.server import INTERNAL_TOKEN, Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152  # SmolLM2's
N_REQUESTS = 2000
CONCURRENCY = 16
BODY_LIMIT = 256 << 10
SEED = 20240611
REPR_ERROR = re.compile(r"\w+Error\(|<class ")

LONE = ["\ud800", "\udfff", "a\udc80b", "\udc00\ud800"]  # written as \u escapes by json.dumps, as a client would
ODD_TEXT = ["", " ", "\x00", "é", "日本語", "🙂", "e\u0301", "\u202etxet", "\ufeff", "\uffff", "\U0010ffff", "\r\n\t",
            "<|im_end|>", "<|im_start|>system", "{{ raise }}", "%s%n", "a" * 300, *LONE]
NUMBERS = [0, 1, -1, 2, 3, 0.5, -0.0, 1e-40, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), 2**31 - 1, 2**31,
           -2**31 - 1, 2**63, 2**64 - 1, 2**64, -2**63 - 1, 10**30, 1.0, 2.0, 1e-6]


def random_value(rng: random.Random, depth: int = 0):
    """Any JSON value: the types a careless or hostile client sends."""
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice(NUMBERS)
    if kind == 3:
        return rng.choice([rng.randint(-5, 60000), rng.uniform(-3, 3)])
    if kind == 4:
        return rng.choice(ODD_TEXT + ["yes", "no", "true", "1", "0.5", "NaN", "text", "user", MODEL])
    if kind in (5, 6):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["type", "text", "role", "content", "x", "include_usage", "\ud800"]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def message(rng: random.Random) -> dict:
    content = rng.choice([rng.choice(ODD_TEXT[:12]) + " hi", "What is 2+2?", None, [{"type": "text", "text": "Hi"}],
                          [{"type": "text", "text": "a"}, {"type": "text", "text": rng.choice(ODD_TEXT)}],
                          [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], [{"type": "text"}],
                          [{"type": "text", "text": 5}], [], rng.choice(ODD_TEXT)])
    m = {"role": rng.choice(["user"] * 6 + ["system", "assistant", "developer", "tool", "function", "", "User"]),
         "content": content}
    if rng.random() < 0.1:
        m["name"] = rng.choice(["bob", "", "\ud800", "n" * 300])
    return m


# Values near each field's edges, so that many requests are valid and reach the engine.
PLAUSIBLE = {
    "model": [MODEL, "gpt-4", "", MODEL + "\ud800", "m" * 300],
    "max_tokens": [1, 2, 3, 0, -1, 600, 2**31, 4.0, "3"],
    "max_completion_tokens": [1, 2, 3, 0, 600, None],
    "temperature": [0, 0.7, 1, 2, 2.1, -0.1, 1e-6, 1e-5, "0"],
    "top_p": [0.1, 0.9, 1, 0, 1.1, 1e-9],
    "top_k": [-1, 0, 1, 5, 50, 10**6, -2, 2**31],
    "min_p": [0, 0.05, 0.5, 1, 1.1],
    "presence_penalty": [-2, 0, 1.5, 2, 2.5],
    "frequency_penalty": [-2, 0, 1.5, 2, -3],
    "repetition_penalty": [0.01, 0.5, 1, 1.3, 10, 0, 1e-30, 11],
    "seed": [0, 1, 42, 2**63, 2**64 - 1, 2**64, -1, -2**63, -2**63 - 1, 10**40],
    "min_tokens": [0, 1, 2, 3, 5, -1, 2**31],
    "stop": [[], "the", [".", ","], [""], ["a"] * 17, ["\ud800"], ["x" * 200], "\n", ["2", "4", "four"]],
    "stop_token_ids": [[], [2], [0, 1], [-1], [VOCAB - 1], [VOCAB], [10**6], list(range(300)), [2**31]],
    "priority": [0, -5, 10, 2**31 - 1, 2**31, -2**31, -2**31 - 1],
    "n": [1, 2, 0, 128],
    "user": ["u1", "", "x" * 300],
    "stream": [True, False],
    "stream_options": [{"include_usage": True}, {"include_usage": False}, {}, {"x": 1}, None],
    "logit_bias": [{}, {"50": 5}, None],
    "ignore_eos": [True, False],
    "include_stop_str_in_output": [True, False],
    "echo": [False, True],
    "best_of": [None, 1, 2],
    "suffix": [None, "", "end"],
    "top_logprobs": [0, 3, 20, 21, None],
    "tools": [None, [], [{"type": "function", "function": {"name": "f"}}]],
    "tool_choice": [None, "none", "auto"],
    "functions": [None, []],
    "function_call": [None, "auto"],
    "response_format": [None, {"type": "text"}, {"type": "json_object"}, {}],
    "parallel_tool_calls": [None, True],
    "unknown_field": [1, "x"],
}
COMMON = ["model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "min_p", "repetition_penalty",
          "min_tokens", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "priority", "unknown_field"]
ONLY = {"/v1/completions": ["prompt", "logprobs", "echo", "best_of", "suffix"],
        "/v1/chat/completions": ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                 "tool_choice", "functions", "function_call", "response_format", "parallel_tool_calls"]}


def plausible(rng: random.Random, path: str, name: str):
    if name == "prompt":
        return rng.choice(["Hello", "", rng.choice(ODD_TEXT), [1, 2, 3], [], [VOCAB - 1], [VOCAB], [-1], ["Hi"],
                           [[5, 6]], ["a", "b"], [[1], [2]], [True], "word " * 600])
    if name == "messages":
        return [message(rng) for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))]
    if name == "logprobs":
        return rng.choice([True, False] if path == "/v1/chat/completions" else [None, 0, 1, 5, 20, 21, -1])
    return rng.choice(PLAUSIBLE[name])


def field_case(rng: random.Random) -> tuple[str, dict]:
    path = rng.choice(list(ONLY))
    body = {"model": MODEL, "max_tokens": rng.choice([1, 2]), "temperature": rng.choice([0, 0.8])}
    body |= {"prompt": "Hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    body["stream"] = rng.random() < 0.4
    for name in rng.sample(COMMON + ONLY[path], rng.choice([1, 1, 2, 3, 5])):
        if rng.random() < 0.3:
            body.pop(name, None)
        else:
            body[name] = plausible(rng, path, name) if rng.random() < 0.7 else random_value(rng)
    if path == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 3  # unbounded would run to the end of the context: slow, not more telling
    return path, body


def encode(rng: random.Random, body) -> bytes:
    if rng.random() < 0.8:
        return json.dumps(body).encode()  # lone surrogates as \u escapes, NaN and Infinity as bare literals
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")  # CESU bytes: not UTF-8


def broken_case(rng: random.Random) -> tuple[str, bytes]:
    path = rng.choice(list(ONLY) + ["/v1/kv/prefill"])
    good = json.dumps({"model": MODEL, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]})
    depth = rng.choice([50, 900, 5000, 100_000])
    raw = rng.choice([
        good[:rng.randrange(len(good))], good + "garbage", good.replace(":", "=", 1), "", "null", "[]", "5", '"x"',
        "[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth,
        good[:-1] + ', "seed": ' + "9" * rng.choice([20, 4000, 5000]) + "}",
        good[:-1] + ', "prompt": ' + "[" * depth + "]" * depth + "}",
        good[:-1] + ', "temperature": 1e999}', good[:-1] + ', "model": "a", "model": 5}',
        '{"model": "\\ud800", "prompt": "\\udfff"}', '{"\\ud800": 1}', '{"model": "x", "logit_bias": {"\\ud800": "a"}}',
        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))), b'{"prompt": "\xff\xfe"}', "\ufeff" + good,
    ])
    return path, raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")


def prefill_case(rng: random.Random) -> tuple[str, dict]:
    names = ["temperature", "top_k", "seed", "stop", "stop_token_ids", "min_tokens", "max_tokens", "logprobs",
             "ignore_eos", "repetition_penalty", "presence_penalty", "unknown_field"]
    sampling = {name: plausible(rng, "/v1/completions", name) if rng.random() < 0.6 else random_value(rng)
                for name in rng.sample(names, 2)}
    ids = rng.choice([[1, 2, 3]] * 4 + [[], [VOCAB], [True], "abc", [[1]], [-1]])
    sampling = sampling if rng.random() < 0.9 else random_value(rng)
    return "/v1/kv/prefill", {"prompt_token_ids": ids, "sampling": sampling}


def cases(rng: random.Random):
    for i in range(N_REQUESTS):
        r = rng.random()
        if i % 200 == 0:  # oversized; every other one chunked, with no Content-Length to refuse it up front
            path, raw = rng.choice(list(ONLY)), b'{"model": "' + b"x" * (BODY_LIMIT + 10) + b'"}'
        elif r < 0.8:
            path, body = field_case(rng)
            raw = encode(rng, body)
        elif r < 0.95:
            path, raw = broken_case(rng)
        else:
            path, body = prefill_case(rng)
            raw = encode(rng, body)
        yield path, raw


def check_response(r: httpx.Response, text: str) -> str | None:
    """What is wrong with one answer, or None."""
    if r.status_code >= 500:
        return f"status {r.status_code}"
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json"):
        try:
            return None if json.loads(text)["choices"] else "no choices in the answer"
        except (ValueError, KeyError, TypeError):
            return "a 200 answer without choices"
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        try:
            events = [json.loads(d) for d in data if d != "[DONE]"]
        except ValueError:
            return "stream carries an event that is not JSON"
        if not data or not (data[-1] == "[DONE]" or "error" in events[-1]):
            return "stream did not end with [DONE] or an error event"
        errors = [e["error"]["message"] for e in events if "error" in e]
        return next((f"exception repr in stream error: {m}" for m in errors if REPR_ERROR.search(m)), None)
    if r.status_code == 200:
        return None
    try:
        err = json.loads(text)["error"]
        assert isinstance(err["message"], str) and err["code"] == r.status_code and err["type"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return "error body is not OpenAI-shaped"
    return f"exception repr in error message: {err['message']}" if REPR_ERROR.search(err["message"]) else None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The service's internal token, as in a cluster: the engine answers only its router.
    srv = Server("--max-model-len", "512", "--max-num-seqs", "16", "--max-request-bytes", str(BODY_LIMIT),
                 log=tmp_path_factory.mktemp("fuzz") / "server.log", env={INTERNAL_TOKEN_ENV: INTERNAL_TOKEN})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def router(server, tmp_path_factory):
    proc = RouterProc("--upstream", server.url, "--max-body-bytes", str(BODY_LIMIT), "--max-model-len", "512",
                      log=tmp_path_factory.mktemp("fuzz-router") / "router.log",
                      env={INTERNAL_TOKEN_ENV: INTERNAL_TOKEN}).wait_ready()
    try:
        yield proc
    finally:
        proc.stop()


async def fire(url: str, all_cases: list[tuple[str, bytes]], headers: dict[str, str] | None = None
               ) -> tuple[collections.Counter, list[str], float]:
    codes, problems, slowest = collections.Counter(), [], 0.0
    gate = asyncio.Semaphore(CONCURRENCY)

    async def chunks(raw: bytes):
        step = 16 << 10
        for i in range(0, len(raw), step):
            yield raw[i:i + step]

    async def one(client: httpx.AsyncClient, i: int, path: str, raw: bytes) -> None:
        nonlocal slowest
        async with gate:
            t0 = time.monotonic()
            try:
                content = chunks(raw) if i % 400 == 200 else raw
                r = await client.post(path, content=content, headers={"content-type": "application/json",
                                                                      **(headers or {})})
                text = r.text
            except httpx.HTTPError as e:
                codes["transport error"] += 1
                problems.append(f"{type(e).__name__} on {path} {raw[:200]!r}")
                return
            codes[r.status_code] += 1
            wrong, took = check_response(r, text), time.monotonic() - t0
            slowest = max(slowest, took)
            if took > 60:
                wrong = f"answered after {took:.0f} s"
            if wrong:
                problems.append(f"{wrong} on {path} {raw[:300]!r} -> {text[:300]!r}")

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=CONCURRENCY)) as c:
        await asyncio.gather(*(one(c, i, path, raw) for i, (path, raw) in enumerate(all_cases)))
    return codes, problems, slowest


def fuzz_and_check(url: str, server: Server, headers: dict[str, str] | None, logs: list) -> None:
    """2,000 generated requests at `url`; then nothing went wrong, a normal request answers, the engine is well."""
    t0 = time.monotonic()
    codes, problems, slowest = asyncio.run(fire(url, list(cases(random.Random(SEED))), headers))
    summary = (f"{sum(codes.values())} requests in {time.monotonic() - t0:.0f} s (slowest {slowest:.1f} s), "
               f"status counts {dict(codes)}")
    print("\nfuzz:", summary)
    assert sum(codes.values()) == N_REQUESTS
    assert not problems, f"{summary}; {len(problems)} problems:\n" + "\n".join(problems[:30])
    r = httpx.post(url + "/v1/chat/completions", timeout=60, headers=headers, json={
        "model": MODEL, "max_tokens": 30, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
    for base in {url, server.url}:
        assert httpx.get(base + "/ready").status_code == 200
        assert httpx.get(base + "/health").status_code == 200
    deadline = time.monotonic() + 30
    while (usage := server.metrics()["vllm:kv_cache_usage_perc{}"]) != 0:
        assert time.monotonic() < deadline, f"KV cache usage stays at {usage} after the fuzz"
        time.sleep(0.2)
    for log in logs:
        text = log.read_text()
        assert "Traceback" not in text, text[text.index("Traceback") - 300:][:3000]


def test_fuzz_never_5xx_and_leaves_engine_healthy(server):
    fuzz_and_check(server.url, server, {"authorization": f"Bearer {INTERNAL_TOKEN}"}, [server.log])


def test_fuzz_through_the_router(router, server):
    fuzz_and_check(router.url, server, None, [server.log, router.log])
