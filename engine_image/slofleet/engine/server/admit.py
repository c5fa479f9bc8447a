"""`slofleet serve --bucket-ttft-ms`: a lone engine refuses a request whose time to first token would miss its
bucket's target, by the router's predictor (slofleet.router.predict) on this one replica, with 429 and Retry-After
before any engine work. Every request counts as work ahead of the others, with or without a target."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from slofleet.router.predict import Claim, Predictor, retry_after

from ..errors import AdmissionError

HERE = "self"  # the predictor's name for this engine


@dataclass(slots=True, kw_only=True)
class Watch:
    """One admitted request until it ends: its claim, released at its first output; its outputs after that."""
    claim: Claim
    first_at: float | None = None
    outputs: int = 0


class LocalAdmission:
    def __init__(self, targets: dict[str, float], predictor: Predictor | None = None):
        self.targets, self.predictor = targets, predictor or Predictor()

    def watch(self, engine, bucket: str, priority: int | None, prompt: str | list[int]) -> Watch:
        """Admit a request to the engine (an LLMEngine), at its own priority or else its bucket's."""
        level = engine.bucket_priorities.get(bucket, 0) if priority is None else priority
        return self.admit(bucket, len(prompt) if isinstance(prompt, list) else len(engine.tokenize(prompt)), level)

    def admit(self, bucket: str, tokens: int, priority: int) -> Watch:
        """The request's watch, or AdmissionError when its bucket's target (seconds) would be missed."""
        now, target = time.monotonic(), self.targets.get(bucket)
        if target is not None:
            p = self.predictor.predict(HERE, tokens, priority, now)
            if p.ttft_s > target * self.predictor.rates.headroom and not p.first:
                raise AdmissionError(f"bucket {bucket!r} (priority {priority}) would miss its time to first token "
                                     f"target of {target * 1000:g} ms: {p.ahead} prompt tokens are queued ahead of "
                                     f"it, predicted {p.ttft_s * 1000:.0f} ms; retry later",
                                     retry_after(p.ttft_s, target))
        return Watch(claim=self.predictor.claim(HERE, tokens, priority, now))

    def output(self, w: Watch) -> None:
        """An output of the watched request: the first teaches the prefill rate."""
        if w.first_at is None:
            w.first_at = time.monotonic()
            self.predictor.first_byte(w.claim, w.first_at)
        w.outputs += 1

    def end(self, w: Watch) -> None:
        """The request ended (or failed, or its client left): the decode step from its outputs after the first."""
        self.predictor.release(w.claim)
        if w.first_at is not None:
            self.predictor.streamed(HERE, w.outputs, time.monotonic() - w.first_at)


def watched(admission: LocalAdmission | None, w: Watch | None, outputs: AsyncIterator) -> AsyncIterator:
    """The request's outputs, watched until they end (as they are without a watch)."""
    return outputs if w is None else _watch(admission, w, outputs)


async def _watch(admission: LocalAdmission, w: Watch, outputs: AsyncIterator) -> AsyncIterator:
    try:
        async for out in outputs:
            admission.output(w)
            yield out
    finally:
        admission.end(w)
