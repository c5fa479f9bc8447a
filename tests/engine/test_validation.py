"""Input validation at the edge: each hole in the OpenAI endpoints' checking gets a 400 that says what to fix,
and none of them reaches the engine thread (the last test checks the engine still serves)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--max-model-len", "512", log=tmp_path_factory.mktemp("validation") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def post(server: Server, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def refused(server: Server, path: str, body: dict | str, *needles: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, (body if isinstance(body, str) else json.dumps(body)[:300], r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400, err
    for needle in needles:
        assert needle in err["message"], (needle, err["message"])


def chat(server, needles, **fields):
    refused(server, "/v1/chat/completions", CHAT | fields, *needles)


def completion(server, needles, **fields):
    refused(server, "/v1/completions", COMPLETION | fields, *needles)


def test_logprobs_in_0_to_20_and_typed(server):
    completion(server, ["logprobs", "[0, 20]"], logprobs=21)
    completion(server, ["logprobs", "integer"], logprobs=True)
    chat(server, ["top_logprobs", "[0, 20]"], logprobs=True, top_logprobs=21)
    chat(server, ["top_logprobs", "[0, 20]"], top_logprobs=-1)
    chat(server, ["top_logprobs", "logprobs"], top_logprobs=3)  # would be ignored silently
    chat(server, ["logprobs", "boolean"], logprobs=1)


def test_top_k_off_or_positive_integer(server):
    completion(server, ["top_k", "-1"], top_k=-2)
    completion(server, ["top_k", "integer"], top_k="5")
    completion(server, ["top_k", "integer"], top_k=1.0)
    assert post(server, "/v1/completions", COMPLETION | {"top_k": 0}).status_code == 200  # 0 is off, as in vLLM


def test_float_ranges(server):
    chat(server, ["temperature", "[0, 2]"], temperature=2.5)
    chat(server, ["top_p", "(0, 1]"], top_p=1.5)
    chat(server, ["min_p", "[0, 1]"], min_p=-0.1)
    chat(server, ["presence_penalty", "[-2, 2]"], presence_penalty=3)
    chat(server, ["frequency_penalty", "[-2, 2]"], frequency_penalty=-2.5)
    chat(server, ["repetition_penalty"], repetition_penalty=0)
    chat(server, ["repetition_penalty"], repetition_penalty=1e-40)  # logits / 1e-40 overflow float32 to inf


def test_nan_and_infinity_refused(server):
    for field in ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]:
        for literal in ["NaN", "Infinity", "-Infinity", "1e999"]:
            body = json.dumps(CHAT)[:-1] + f', "{field}": {literal}}}'
            refused(server, "/v1/chat/completions", body, field)


def test_numbers_are_not_strings(server):
    completion(server, ["temperature", "number"], temperature="0.5")
    completion(server, ["max_tokens", "integer"], max_tokens="5")
    completion(server, ["seed", "integer"], seed="1")
    chat(server, ["n", "integer"], n="1")
    completion(server, ["best_of", "integer"], best_of="1")


def test_booleans_are_strict(server):
    chat(server, ["stream", "boolean"], stream="yes")
    chat(server, ["ignore_eos", "boolean"], ignore_eos=1)
    completion(server, ["echo", "boolean"], echo="false")
    completion(server, ["include_stop_str_in_output", "boolean"], include_stop_str_in_output="true")
    chat(server, ["include_usage", "boolean"], stream=True, stream_options={"include_usage": "no"})


def test_stream_options_need_stream(server):
    chat(server, ["stream_options", "stream"], stream_options={"include_usage": True})


def test_max_tokens_at_least_1_and_integer(server):
    completion(server, ["max_tokens", ">= 1"], max_tokens=0)
    chat(server, ["max_completion_tokens", ">= 1"], max_completion_tokens=0)
    completion(server, ["max_tokens", "integer"], max_tokens=True)
    completion(server, ["max_tokens", "integer"], max_tokens=2.0)


def test_min_tokens_at_most_max_tokens(server):
    completion(server, ["min_tokens", "max_tokens"], min_tokens=5, max_tokens=2)
    chat(server, ["min_tokens", "max_tokens"], min_tokens=5, max_completion_tokens=2)
    completion(server, ["min_tokens", "integer"], min_tokens=1.5)
    chat(server, ["min_tokens"], min_tokens=2**40, max_tokens=None)


def test_stop_at_most_16_non_empty_strings(server):
    completion(server, ["stop", "16"], stop=[f"s{i}" for i in range(17)])
    completion(server, ["stop", "empty"], stop=["a", ""])
    completion(server, ["stop", "empty"], stop="")
    completion(server, ["stop", "string"], stop=[1])
    completion(server, ["stop", "string"], stop={"a": 1})


def test_stop_token_ids_bounded_and_non_negative(server):
    completion(server, ["stop_token_ids", ">= 0"], stop_token_ids=[-1])
    completion(server, ["stop_token_ids", "256"], stop_token_ids=list(range(257)))
    completion(server, ["stop_token_ids", "integer"], stop_token_ids=["2"])


def test_priority_within_int32(server):
    completion(server, ["priority"], priority=2**31)
    completion(server, ["priority"], priority=-2**31 - 1)
    completion(server, ["priority", "integer"], priority="1")


def test_n_and_user(server):
    chat(server, ["n"], n=0)
    chat(server, ["n", "[1, 128]"], n=129)
    chat(server, ["user", "256"], user="u" * 257)
    chat(server, ["user", "string"], user=5)


def test_message_roles_and_content_parts(server):
    def messages(*msgs):
        return {"messages": list(msgs)}
    chat(server, ["messages.0.role"], **messages({"role": "function", "content": "x"}))
    chat(server, ["messages.0.content", "'image_url'", "not supported"], **messages({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}))
    chat(server, ["messages.0.content", "part 0", "string"],
         **messages({"role": "user", "content": [{"type": "text", "text": 5}]}))
    chat(server, ["messages.0.content", "part 0"], **messages({"role": "user", "content": [{"type": "text"}]}))
    chat(server, ["messages.0.content", "part 0", "no other keys"], **messages({"role": "user", "content": [
        {"type": "text", "text": "a", "cache": True}]}))
    chat(server, ["messages.0.content", "part 0"], **messages({"role": "user", "content": ["just a string"]}))
    chat(server, ["messages.0.content"], **messages({"role": "user", "content": 5}))
    chat(server, ["messages"], messages=[])
    ok = post(server, "/v1/chat/completions", CHAT | messages({"role": "user", "content": [
        {"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}))
    assert ok.status_code == 200, ok.text


def test_prompt_types(server):
    completion(server, ["prompt", "integer"], prompt=[1, True])
    completion(server, ["prompt"], prompt=[1.5])
    completion(server, ["prompt"], prompt={"text": "a"})
    completion(server, ["prompt", ">= 0"], prompt=[-1])


def test_lone_surrogates_refused(server):
    # json.dumps writes a lone surrogate as the escape \udc80, which json.loads turns back into one
    chat(server, ["messages.0.content", "surrogate"], messages=[{"role": "user", "content": "a\udc80b"}])
    chat(server, ["messages.0.content", "part 0", "surrogate"],
         messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}])
    completion(server, ["prompt", "surrogate"], prompt="\udfff")
    completion(server, ["stop", "surrogate"], stop=["\ud800"])
    completion(server, ["user", "surrogate"], user="\ud800")


def test_prefill_endpoint_checks_sampling_types(server):
    for sampling in [{"seed": 2**64}, {"stop_token_ids": ["a"]}, {"temperature": "1"}, {"ignore_eos": "yes"}]:
        refused(server, "/v1/kv/prefill", {"prompt_token_ids": [1, 2, 3], "sampling": sampling}, next(iter(sampling)))
    refused(server, "/v1/kv/prefill", {"prompt_token_ids": [1, True]}, "prompt_token_ids")
    refused(server, "/v1/kv/prefill", {"prompt_token_ids": [1], "sampling": {"\ud800": 1}}, "unknown field", "\\ud800")
    # An integer penalty reached the sampler as an int and made its tensor Long: the step failed.
    r = post(server, "/v1/kv/prefill", {"prompt_token_ids": [1, 2, 3], "sampling": {"repetition_penalty": 2}})
    assert r.status_code == 200, r.text


def test_huge_integer_literal(server):
    body = json.dumps(COMPLETION)[:-1] + ', "seed": ' + "9" * 5000 + "}"  # over Python's int_max_str_digits
    refused(server, "/v1/completions", body, "too many digits")


def test_seed_within_generator_range(server):
    # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; beyond it the engine thread used to die.
    completion(server, ["seed", "[-9223372036854775808, 18446744073709551615]"], seed=2**64)
    completion(server, ["seed"], seed=-2**63 - 1)
    completion(server, ["seed", "integer"], seed=1.0)
    for seed in (2**64 - 1, -2**63):
        r = post(server, "/v1/completions", COMPLETION | {"seed": seed, "temperature": 1})
        assert r.status_code == 200, r.text


def test_engine_still_serves(server):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 30, "temperature": 0, "messages": question})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
    assert httpx.get(server.url + "/health").status_code == 200
    deadline = time.monotonic() + 30
    while server.metrics()["vllm:kv_cache_usage_perc{}"] != 0:
        assert time.monotonic() < deadline, "KV blocks not returned"
        time.sleep(0.2)
    assert "Traceback" not in server.log.read_text()
