"""Streaming request driver of `slofleet bench` and the load and soak scripts (benchmarks/): one request, its TTFT,
TPOT, inter-token latencies and E2E, against any OpenAI-compatible server (chat or completions)."""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

import httpx

from slofleet.api.contract import BUCKET_HEADER

WORDS = ("the a river of engine quiet garden window market theory planet music letter forest winter machine "
         "story bridge lantern harbor circuit memory ocean desert village candle rhythm").split()


def words(n: int, rng: random.Random) -> str:
    """n words drawn from WORDS: common enough that most tokenizers make about one token of each."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prompt(n: int, rng: random.Random, prefix: int = 0, head: int = 0) -> str:
    """n words, of which the first `prefix` are the same in every prompt with that prefix length and `head` (a
    run's seed: another run's shared head is not in a prefix cache)."""
    if not prefix:
        return words(n, rng)
    return words(prefix, random.Random(f"{head}/{prefix}" if head else prefix)) + " " + words(max(0, n - prefix), rng)


@dataclass
class Result:
    bucket: str
    status: int
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0  # generated: the server's usage when it reports one, else the chunks with text
    error: str = ""
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)  # seconds between consecutive chunks with text
    prompt_tokens: int = 0  # the server's usage, when it reports one
    start: float = 0.0  # when it was sent, in seconds from the caller's origin (time.perf_counter() by default)


@dataclass
class Bucket:
    name: str
    words: tuple[int, int]  # prompt length range, in words
    max_tokens: int
    ttft_slo: float
    tpot_slo: float
    share: float
    prefix: int = 0  # the first `prefix` words are the same in every request of the bucket (a shared document head)

    def text(self, rng: random.Random) -> str:
        return prompt(rng.randint(*self.words), rng, self.prefix)

    def body(self, model: str, rng: random.Random, completion: bool = False) -> dict:
        """A streaming request with usage in its last chunk; greedy, so every system gets the same work."""
        out = {"model": model, "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": True}
        if completion:
            return out | {"prompt": self.text(rng)}
        return out | {"messages": [{"role": "user", "content": "Summarise: " + self.text(rng)}]}


# The load mix of issue #14, the default of benchmarks/load.py and `slofleet bench`: short chats, ~500-token
# documents sharing a 120-word head, long outputs; (prompt words, output tokens, TTFT/TPOT SLO in s, share).
MIX = [Bucket("chat", (20, 60), 24, ttft_slo=2.0, tpot_slo=0.4, share=0.6),
       Bucket("doc", (480, 520), 8, ttft_slo=6.0, tpot_slo=0.4, share=0.25, prefix=120),
       Bucket("long-output", (20, 40), 64, ttft_slo=2.0, tpot_slo=0.4, share=0.15)]


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, bucket: str,
                     cancel_after: int | None = None, send_ignore_eos: bool = True,
                     path: str = "/v1/chat/completions", headers: dict[str, str] | None = None,
                     origin: float = 0.0, send_bucket: bool = True) -> Result:
    """Send one streaming request (chat, or a completion when `path` is one); stop reading after cancel_after
    chunks (a disconnect). `bucket` labels the result, and goes to the server as its bucket header if send_bucket."""
    if not send_ignore_eos:
        body = {k: v for k, v in body.items() if k != "ignore_eos"}
    headers = {**({BUCKET_HEADER: bucket} if send_bucket else {}), **(headers or {})}
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    try:
        async with client.stream("POST", url + path, json=body,
                                 headers=headers) as r:
            if r.status_code != 200:
                return Result(bucket, r.status_code, error=(await r.aread()).decode()[:200], start=t0 - origin)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                choice = (chunk.get("choices") or [{}])[0]
                if choice.get("delta", {}).get("content") or choice.get("text"):
                    times.append(time.perf_counter())
                    if cancel_after is not None and len(times) >= cancel_after:
                        return Result(bucket, 499, tokens=len(times), start=t0 - origin)
                elif choice.get("finish_reason") and not times:
                    # an answer without text (the model's first token ends it): its one token arrived now
                    times.append(time.perf_counter())
    except httpx.HTTPError as e:
        return Result(bucket, 0, error=repr(e), start=t0 - origin)
    end = time.perf_counter()
    if not times:
        return Result(bucket, 200, error="no tokens", start=t0 - origin)
    tokens = usage.get("completion_tokens") or len(times)
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else 0.0
    return Result(bucket, 200, times[0] - t0, tpot, tokens, e2e=end - t0,
                  itls=[b - a for a, b in zip(times, times[1:])], prompt_tokens=usage.get("prompt_tokens", 0),
                  start=t0 - origin)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]
