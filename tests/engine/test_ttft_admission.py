"""`slofleet serve --bucket-ttft-ms`: a lone engine refuses by the router's predictor. The unit part drives
LocalAdmission by hand; the slow part floods the real engine and checks the refusals' form and that the bucket
without a target is never refused."""
from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import pytest

from slofleet.engine.errors import AdmissionError
from slofleet.engine.server.admit import HERE, LocalAdmission, watched
from slofleet.engine.server.settings import ServerSettings
from slofleet.router.predict import Predictor, Rates
from tests.support.server import Server

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's name


def test_a_lone_engine_refuses_what_would_miss_and_learns_from_its_outputs():
    a = LocalAdmission({"chat": 0.5}, Predictor(Rates(prefill_tps=1000, step_s=0.0, headroom=1.0)))
    first = a.admit("bulk", 2000, 5)  # no target: admitted, and counted as work
    a.admit("chat", 400, 0)  # the bulk prompt is below its priority: 0.4 s
    with pytest.raises(AdmissionError) as e:
        a.admit("chat", 200, 0)  # 600 tokens: 0.6 s > 0.5 s
    assert "'chat'" in str(e.value) and e.value.retry_after >= 1

    async def outputs():
        for i in range(3):
            yield i

    async def drain() -> list[int]:
        return [x async for x in watched(a, first, outputs())]

    assert asyncio.run(drain()) == [0, 1, 2]
    assert first.outputs == 3 and a.predictor.clocks[HERE].prefill_samples == 1
    assert a.predictor.ahead(HERE, 9) == 400  # the bulk request left the count


def test_the_flag_is_checked_at_start():
    with pytest.raises(ValueError, match="bucket_ttft_ms"):
        ServerSettings(bucket_ttft_ms="chat=soon")


@pytest.mark.slow
def test_serve_refuses_a_flood_with_429_and_retry_after(tmp_path):
    s = Server("--bucket-ttft-ms", "chat=300", "--bucket-priorities", "chat=0,bulk=5", log=tmp_path / "serve.log")
    s.wait_ready()
    try:
        def one(i: int, bucket: str) -> httpx.Response:
            body = {"model": MODEL, "prompt": f"{i} " + "Tell me about the sea. " * 20, "max_tokens": 2}
            return httpx.post(s.url + "/v1/completions", json=body, headers={"x-slofleet-bucket": bucket}, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            chat = list(pool.map(lambda i: one(i, "chat"), range(12)))
        bulk = [one(100 + i, "bulk") for i in range(2)]
        m = s.metrics()
    finally:
        s.stop()
    refused = [r for r in chat if r.status_code == 429]
    assert refused and len(refused) < len(chat), [r.status_code for r in chat]
    assert all(r.status_code in (200, 429) for r in chat)
    assert all(int(r.headers["retry-after"]) >= 1 and "'chat'" in r.json()["error"]["message"] for r in refused)
    assert all(r.status_code == 200 for r in bulk)  # no target: never refused by the prediction
    assert sum(v for k, v in m.items() if "refus" in k and "bucket=chat" in k) >= len(refused)
