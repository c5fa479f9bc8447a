"""What `slofleet bench` sends and when: a real trace's requests (slofleet.autoscaler.traces: their arrival times,
prompt and output lengths) time-scaled to a rate, or a synthetic mix with Poisson arrivals; each request put in a
bucket by the rules of an LLMService or SLOPolicy file, as the router would, or by the mix it came from."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from slofleet.router.buckets import Classifier, load_buckets

from .loadgen import MIX, prompt

TRACES = ("conversation", "code", "long")  # slofleet.autoscaler.traces.FILES: ../shared/data/traces


@dataclass
class Item:
    at: float  # seconds after the start
    bucket: str
    prompt_tokens: int  # as sent (one token per word, see loadgen.words)
    max_tokens: int
    seed: int  # of its prompt text
    prefix: int = 0  # leading words shared by every request of its bucket
    head: int = 0  # the seed of those shared words: the run's, so that another run's are not cached


@dataclass
class Target:
    """A bucket's SLO, in seconds (None: no target); from the resource's spec.buckets[].slo."""
    percentile: float
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None


def arrivals(rate: float, n: int | None, duration: float | None, rng: random.Random) -> list[float]:
    """Poisson arrivals at `rate` per second (all at once when infinite): n of them, or those within duration."""
    out, t = [], 0.0
    while (n is None or len(out) < n) and (duration is None or t < duration):
        out.append(t)
        if math.isinf(rate):
            if n is None:
                raise ValueError("an infinite rate needs --num-prompts")
            continue
        t += rng.expovariate(rate)
    return out


def synthetic(rate: float, n: int | None, duration: float | None, seed: int) -> list[Item]:
    rng = random.Random(seed)
    out = []
    for at in arrivals(rate, n, duration, rng):
        b = rng.choices(MIX, [b.share for b in MIX])[0]
        out.append(Item(at, b.name, rng.randint(*b.words), b.max_tokens, rng.getrandbits(32), b.prefix, seed))
    return out


def replay(name: str, rate: float | None, n: int | None, duration: float | None, seed: int) -> list[Item]:
    """The trace's requests in order, its own arrival times scaled so that its mean rate is `rate` (as recorded
    when None)."""
    from slofleet.autoscaler import traces  # numpy and the trace files, only for a replay

    trace = traces.load(name)
    speed = 1.0 if rate is None else rate / trace.rate
    rng = random.Random(seed)
    out = []
    for at, length, output in zip(trace.arrival / speed, trace.prompt, trace.output):
        if (n is not None and len(out) >= n) or (duration is not None and at >= duration):
            break
        out.append(Item(float(at), name, int(length), int(output), rng.getrandbits(32)))
    return out


def targets_of(path: str) -> tuple[Classifier, dict[str, Target]]:
    """The file's buckets (a list, `{buckets: [...]}`, or an LLMService/SLOPolicy) parsed with the resource's models,
    and their SLOs in seconds."""
    buckets = load_buckets(path)
    return Classifier(buckets), {b.name: Target(b.slo.percentile, *(None if v is None else v / 1000 for v in (
        b.slo.ttft_ms, b.slo.tpot_ms, b.slo.e2e_ms))) for b in buckets if b.slo is not None}


def mix_targets() -> dict[str, Target]:
    """The synthetic mix's own SLOs (loadgen.MIX), for a run without --buckets."""
    return {b.name: Target(95.0, b.ttft_slo, b.tpot_slo) for b in MIX}


def clip(items: list[Item], max_prompt: int | None, max_output: int | None) -> None:
    """Cap lengths to what a small server takes (real traces hold prompts of tens of thousands of tokens)."""
    for it in items:
        it.prompt_tokens = max(1, min(it.prompt_tokens, max_prompt or it.prompt_tokens))
        it.max_tokens = max(1, min(it.max_tokens, max_output or it.max_tokens))


def classify(items: list[Item], classifier: Classifier, path: str) -> None:
    for it in items:
        it.bucket = classifier.classify(it.prompt_tokens, it.max_tokens, {}, path).name


def body(it: Item, model: str, path: str, ignore_eos: bool) -> dict:
    text = prompt(it.prompt_tokens, random.Random(it.seed), it.prefix, it.head)
    out = {"model": model, "max_tokens": it.max_tokens, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}, **({"ignore_eos": True} if ignore_eos else {})}
    if "chat" in path:
        return out | {"messages": [{"role": "user", "content": text}]}
    return out | {"prompt": text}
