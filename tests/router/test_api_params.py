"""The router passes n, /v1/responses and /v1/embeddings to a real engine and puts each path in its own bucket."""
from __future__ import annotations

import json
import time

import openai
import pytest

from tests.support.router import RouterProc
from tests.support.server import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BUCKETS = {"buckets": [{"name": "embed", "priority": 5, "match": {"route": "/v1/embeddings"}},
                       {"name": "agent", "priority": 1, "match": {"route": "/v1/responses"}}]}


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    d = tmp_path_factory.mktemp("apiparams")
    (d / "buckets.json").write_text(json.dumps(BUCKETS))
    engine = Server("--max-model-len", "512", "--num-threads", "1", log=d / "engine.log")
    try:
        engine.wait_ready()
        r = RouterProc("--upstream", engine.url, "--buckets", str(d / "buckets.json"), log=d / "router.log")
        r.wait_ready()
        while not any("replica_ready" in k and v == 1 for k, v in r.metrics().items()):
            time.sleep(0.1)
        yield r
        r.stop()
    finally:
        engine.stop()


def answered(router, bucket: str) -> float:
    return sum(v for k, v in router.metrics().items()
               if k.startswith("slofleet:router_requests_total") and f"bucket={bucket}" in k and "code=200" in k)


def test_n_responses_and_embeddings_through_the_router(router):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3,
                                          max_tokens=4, seed=1)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=8)
    assert r.object == "response" and r.output_text
    kinds = [e.type for e in client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    e = client.embeddings.create(model=MODEL, input=["one", "two"])
    assert len(e.data) == 2 and len(e.data[0].embedding) > 100
    assert answered(router, "agent") == 2 and answered(router, "embed") == 1


def test_refusals_pass_through_unchanged(router):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"use_beam_search": True})
