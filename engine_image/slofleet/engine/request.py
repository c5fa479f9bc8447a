"""A request's state inside the engine, and the lifecycle events that metrics derive from."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from slofleet.api.contract import DEFAULT_BUCKET

from .sampling_params import SEED_RANGE, SamplingParams

if TYPE_CHECKING:
    from .kv_transfer import KVPayload


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Event(enum.Enum):
    """Lifecycle events; metrics and the per-request log line are computed from these alone."""
    ARRIVED = "arrived"
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    PREFILL_CHUNK = "prefill_chunk"  # a step computed part of the prompt (recorded when its forward pass ended)
    FIRST_TOKEN = "first_token"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended; a str so it serialises as the OpenAI API spells it."""
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    DEADLINE = "deadline"  # waited past its deadline before being scheduled
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False, slots=True, kw_only=True)  # identity semantics: requests are compared and removed by object
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    priority: int = 0
    bucket: str = DEFAULT_BUCKET
    deadline: float | None = None  # time.monotonic() by which it must be scheduled
    tpot: float | None = None  # seconds per output token its bucket targets: bounds the prompt work beside it
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_prompt_computed: int = 0  # prompt tokens this engine actually computed (recompute included)
    busy_s: float = 0.0  # this request's share of the engine's step time (each step split over its requests)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    events: list[tuple[Event, float]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    ext_hashes: list[bytes] = field(default_factory=list)  # vLLM's chain (KVCacheManager.external), when asked for
    export_kv: bool = False  # prefill role: hand the prompt's KV blocks out when the first token is sampled
    imported: KVPayload | None = None  # decode role: KV to load instead of computing the prompt
    draft: list[int] = field(default_factory=list)  # speculative tokens to verify after the last one (this step)
    draft_len: int = 0  # the longest next draft (speculative.py): 1 more than the last one kept; 0: not drafted yet
    # n > 1: the samples of one prompt. The first is scheduled; the others wait in its `forks` until its prompt is
    # computed, then share its KV blocks (Scheduler.fork) and sample their first token from its logits.
    sample_index: int = 0
    parent: Request | None = None  # the sample whose prompt KV this one forks
    forks: list[Request] = field(default_factory=list)  # samples waiting for this one's prompt
    group: list[Request] = field(default_factory=list)  # on the first sample of n > 1: all n, in index order

    def __post_init__(self) -> None:
        self.record(Event.ARRIVED, self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def samples(self) -> list[Request]:
        """Every sample of this request (itself when n = 1)."""
        return self.group or [self]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self) -> tuple:
        # Lower priority value runs first (vLLM's convention); then earliest deadline, then arrival.
        return (self.priority, self.deadline if self.deadline is not None else float("inf"), self.arrival_time)

    def record(self, event: Event, t: float | None = None) -> None:
        self.events.append((event, time.monotonic() if t is None else t))

    def first(self, event: Event) -> float | None:
        return next((t for e, t in self.events if e is event), None)

    def count(self, event: Event) -> int:
        return sum(1 for e, _ in self.events if e is event)

    def timings(self) -> dict[str, float]:
        """Queue, prefill, decode and end-to-end seconds, from the lifecycle events."""
        arrived, sched = self.first(Event.ARRIVED), self.first(Event.SCHEDULED)
        first_tok, done = self.first(Event.FIRST_TOKEN), self.first(Event.FINISHED)
        out: dict[str, float] = {}
        if sched is not None:
            out["queue_s"] = sched - arrived
        if first_tok is not None:
            out["ttft_s"] = first_tok - arrived
            if sched is not None:
                out["prefill_s"] = first_tok - sched
        if done is not None:
            out["e2e_s"] = done - arrived
            if first_tok is not None:
                out["decode_s"] = done - first_tok
        return out


def fan_out(first: Request) -> None:
    """Make first the head of a group of first.params.n samples: the others wait in its forks (see Scheduler.fork).
    A seeded request's sample i draws with seed + i (as vLLM's), so the samples differ and repeat run to run."""
    p = first.params
    for i in range(1, p.n):
        seed = None if p.seed is None else (p.seed + i if p.seed + i <= SEED_RANGE[1] else p.seed - i)
        child = Request(request_id=f"{first.request_id}.{i}", prompt_token_ids=first.prompt_token_ids,
                        params=replace(p, seed=seed), max_tokens=first.max_tokens, priority=first.priority,
                        bucket=first.bucket, deadline=first.deadline, tpot=first.tpot, arrival_time=first.arrival_time,
                        sample_index=i, parent=first)
        first.forks.append(child)
    first.group = [first, *first.forks]
