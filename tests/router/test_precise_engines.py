"""`--policy precise` in front of two real engines publishing KV events: the router tokenizes with the model's chat
template and hashes as the engines do, so a prompt whose blocks one engine already holds (put there behind the
router's back) goes to that engine. Prompts are shorter than --affinity-chars, so hashing alone would send them by
load: only the index can find the engine that holds them."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.support.router import RouterProc
from tests.support.server import Server, free_port

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--max-num-seqs", "2", "--num-blocks", "256", "--num-threads", "1")
DOCS = ["The harbor of the old town had three piers, a lighthouse painted red and white, and a market. " * 4,
        "A glacier moves slowly down the valley, carving the rock and leaving moraines where it melts. " * 4]


def chat(url: str, doc: str, question: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
            "max_tokens": 2, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_requests_go_where_their_prefix_is_cached(tmp_path):
    pub, replay = free_port(), free_port()
    engines = []
    for i, host in enumerate(("127.0.0.2", "127.0.0.3")):
        s = Server(*FLAGS, "--host", host, "--kv-events-endpoint", f"tcp://{host}:{pub}",
                   "--kv-events-replay-endpoint", f"tcp://{host}:{replay}", log=tmp_path / f"engine{i}.log")
        s.url = f"http://{host}:{s.port}"
        engines.append(s)
    router = None
    try:
        for s in engines:
            s.wait_ready()
        router = RouterProc(*[f for s in engines for f in ("--upstream", s.url)], "--policy", "precise",
                            "--model", "default", "--affinity-chars", "100000",
                            "--kv-events-endpoint", f"tcp://{{host}}:{pub}",
                            "--kv-events-replay-endpoint", f"tcp://{{host}}:{replay}", log=tmp_path / "router.log")
        router.wait_ready()
        time.sleep(1.0)  # the router's subscriptions connect (a PUB drops what it sends before)
        for doc, holder in ((DOCS[0], engines[1]), (DOCS[1], engines[0])):
            before = router.metrics()["slofleet:router_prefix_index_blocks{}"]
            chat(holder.url, doc, "What is this about?")  # straight to the engine: only its events tell the router
            deadline = time.monotonic() + 10
            while router.metrics()["slofleet:router_prefix_index_blocks{}"] <= before:
                assert time.monotonic() < deadline, "the router's index never saw the engine's blocks"
                time.sleep(0.1)
            for q in ("Summarize it.", "Name one detail.", "Is it true?"):
                assert chat(router.url, doc, q).headers["x-slofleet-replica"] == holder.url
        m = router.metrics()
        assert m["slofleet:router_prefix_index_bytes{}"] > 0
    finally:
        if router is not None:
            router.stop()
        for s in engines:
            s.stop()
