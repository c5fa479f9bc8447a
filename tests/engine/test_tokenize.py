"""vLLM's /tokenize and /detokenize on `slofleet serve` and through the router: a prompt and a chat round-trip,
the count is what a completion's usage reports, and bad input is a 4xx naming the problem."""
from __future__ import annotations

import httpx
import pytest

from tests.support.router import RouterProc
from tests.support.server import serving

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TEXT = "The harbor of the old town had three piers and a lighthouse painted red and white."


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with serving("--max-num-seqs", "2", "--num-blocks", "64", log=tmp_path_factory.mktemp("tok") / "engine.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def router(engine, tmp_path_factory):
    r = RouterProc("--upstream", engine.url, log=tmp_path_factory.mktemp("tokr") / "router.log").wait_ready()
    yield r
    r.stop()


@pytest.fixture(params=["engine", "router"])
def url(request) -> str:
    return request.getfixturevalue(request.param).url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_a_prompt_round_trips_and_counts_as_the_completion_does(url):
    r = post(url, "/tokenize", {"model": MODEL, "prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["count"] == len(got["tokens"]) == len(got["token_strs"]) > 10 and got["max_model_len"] > got["count"]
    assert post(url, "/detokenize", {"model": MODEL, "tokens": got["tokens"]}).json() == {"prompt": TEXT}
    done = post(url, "/v1/completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == got["count"]


def test_a_chat_counts_as_the_chat_endpoint_does(url):
    messages = [{"role": "user", "content": TEXT}]
    got = post(url, "/tokenize", {"messages": messages}).json()
    bare = post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < got["count"] and got["tokens"][:bare["count"]] == bare["tokens"]
    done = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == got["count"]
    assert TEXT in post(url, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"]


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/tokenize", {}, 400, "exactly one of prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "exactly one of prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, 404, "gpt-9"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True}, 400,
     "add_generation_prompt"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "out of range"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
])
def test_bad_input_is_a_4xx_that_says_why(url, path, body, status, says):
    r = post(url, path, body)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text
