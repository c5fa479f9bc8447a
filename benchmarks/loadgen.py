"""Streaming request driver shared by the load and soak scripts: one request, its TTFT and TPOT."""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx

WORDS = ("the a river of engine quiet garden window market theory planet music letter forest winter machine "
         "story bridge lantern harbor circuit memory ocean desert village candle rhythm").split()


@dataclass
class Result:
    bucket: str
    status: int
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str = ""


@dataclass
class Bucket:
    name: str
    words: tuple[int, int]  # prompt length range, in words
    max_tokens: int
    ttft_slo: float
    tpot_slo: float
    share: float

    def body(self, model: str, rng: random.Random) -> dict:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*self.words)))
        return {"model": model, "messages": [{"role": "user", "content": "Summarise: " + text}],
                "max_tokens": self.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, bucket: str,
                     cancel_after: int | None = None, send_ignore_eos: bool = True) -> Result:
    """Send one streaming chat request; stop reading after cancel_after chunks (a disconnect)."""
    if not send_ignore_eos:
        body = {k: v for k, v in body.items() if k != "ignore_eos"}
    t0 = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"x-slofleet-bucket": bucket}) as r:
            if r.status_code != 200:
                return Result(bucket, r.status_code, error=(await r.aread()).decode()[:200])
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    times.append(time.perf_counter())
                    if cancel_after is not None and len(times) >= cancel_after:
                        return Result(bucket, 499, tokens=len(times))
    except httpx.HTTPError as e:
        return Result(bucket, 0, error=repr(e))
    if not times:
        return Result(bucket, 200, error="no tokens")
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return Result(bucket, 200, times[0] - t0, tpot, len(times))


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]
