"""The router's SLO clocks for one relayed answer: TTFT, TPOT and E2E as its client sees them, read from the bytes
relayed (no runtime's metrics needed), and whether they meet the bucket's targets.

A streamed answer's first chunk holds its first token (upstream.first_chunk holds a chat stream's role-only opening
back until the next event), so its TTFT is when that chunk was sent. Output tokens are the answer's own
`usage.completion_tokens` when it carries one, else its content events: vLLM, llama-server and slofleet's engine
send one token per event."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

from slofleet.api.v1alpha1 import SLO, Bucket

from .http1 import Progress
from .metrics import RouterMetrics

USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
CONTENT = re.compile(rb'"(?:content|text)"\s*:\s*"[^"]')  # an event carrying some text
FINISH = re.compile(rb'"finish_reason"\s*:\s*"')  # an event that ends the answer (llama-server's has no text)


@dataclass(slots=True, kw_only=True)
class Clocks:
    """One answer's clocks in seconds; tpot None for an answer of fewer than two tokens, or not streamed."""
    ttft: float
    tpot: float | None
    e2e: float


def output_tokens(first: bytes, got: Progress) -> int:
    """A finished stream's output tokens, from its usage event, else from its events: all but `[DONE]`, a chat's
    role-only opening and a closing event without text (llama-server ends a chat stream with one)."""
    ends = got.before + got.tail if got.chunks else first
    usage = USAGE.search(ends)
    if usage is not None:
        return int(usage.group(1))
    events = first.count(b"\n\n") + got.events
    events -= b"[DONE]" in ends
    opening = first[:first.find(b"\n\n")]
    events -= b'"role"' in opening and CONTENT.search(opening) is None
    last = [e for e in ends.split(b"\n\n") if e.strip() and b"[DONE]" not in e][-1:]
    events -= bool(last) and last[0] != opening and FINISH.search(last[0]) is not None \
        and CONTENT.search(last[0]) is None
    return max(0, events)


def clocks(t0: float, t_first: float, t_end: float, tokens: int, streamed: bool) -> Clocks:
    """The clocks of an answer that arrived at t0, sent its first chunk at t_first and ended whole at t_end."""
    if not streamed:  # a whole JSON answer: its client sees no token before the last byte
        return Clocks(ttft=t_end - t0, tpot=None, e2e=t_end - t0)
    tpot = (t_end - t_first) / (tokens - 1) if tokens >= 2 else None
    return Clocks(ttft=t_first - t0, tpot=tpot, e2e=t_end - t0)


def met(slo: SLO | None, c: Clocks) -> bool | None:
    """Whether every target the bucket sets holds for this answer; None for a bucket without an SLO."""
    if slo is None:
        return None
    return not ((slo.ttft_ms is not None and c.ttft * 1000 > slo.ttft_ms)
                or (slo.tpot_ms is not None and c.tpot is not None and c.tpot * 1000 > slo.tpot_ms)
                or (slo.e2e_ms is not None and c.e2e * 1000 > slo.e2e_ms))


def observe(metrics: RouterMetrics, bucket: Bucket, status: int, first: bytes, got: Progress, t0: float,
            t_first: float, streamed: bool) -> None:
    """A whole answer's clocks (perf_counter seconds) into the bucket's histograms, and its SLO verdict; an error
    status is timed by nothing and judged as not met. A stream's TTFT was observed as its first chunk went out."""
    if status != 200:
        metrics.missed(bucket)
        return
    c = clocks(t0, t_first, time.perf_counter(), output_tokens(first, got) if streamed else 0, streamed)
    observe_clocks(metrics, bucket, c, ttft=not streamed)


def observe_clocks(metrics: RouterMetrics, bucket: Bucket, c: Clocks, ttft: bool = True) -> None:
    """One answer's clocks into its bucket's histograms (TTFT unless already observed), and its SLO verdict."""
    if ttft:
        metrics.ttft.labels(bucket.name).observe(c.ttft)
    if c.tpot is not None:
        metrics.tpot.labels(bucket.name).observe(c.tpot)
    metrics.e2e.labels(bucket.name).observe(c.e2e)
    ok = met(bucket.slo, c)
    if ok is not None:
        metrics.slo.labels(bucket.name, "true" if ok else "false").inc()
