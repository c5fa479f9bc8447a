"""Iteration-level scheduling: one token budget per step shared by decodes and prefill chunks.

B_{t+1} = (B_t minus finished) plus admitted. Running requests are served first, in priority order;
when the KV pool runs short the lowest-priority running request is preempted (its blocks freed, to be
recomputed later). Waiting requests are admitted in (priority, deadline, arrival) order while budget,
sequence slots and blocks last; a prompt larger than the remaining budget is prefilled in chunks.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from .config import EngineConfig
from .kv_cache_manager import KVCacheManager
from .request import PREEMPTED, QUEUED, SCHEDULED, Request, Status


class AdmissionError(Exception):
    """The engine is full: the API turns this into 429 with Retry-After."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)
    preempted: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)  # waited past their deadline

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.preemptions_by_bucket: dict[str, int] = {}
        self.admission_refusals = 0
        self.recent_steps: deque[float] = deque(maxlen=32)  # step durations, for Retry-After

    # -- queue ---------------------------------------------------------------------------
    @property
    def queued_prompt_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def check_admission(self, num_prompt_tokens: int, pending: int = 0, pending_tokens: int = 0) -> None:
        """Raise AdmissionError when one more request would break the limits; pending = not yet queued."""
        cfg = self.config
        waiting, queued = len(self.waiting) + pending, self.queued_prompt_tokens + pending_tokens
        if waiting >= cfg.max_waiting_requests:
            why = f"{waiting} requests already waiting (limit {cfg.max_waiting_requests})"
        elif queued + num_prompt_tokens > cfg.max_queued_tokens:
            why = f"{queued} prompt tokens already queued (limit {cfg.max_queued_tokens})"
        else:
            return
        self.admission_refusals += 1
        step = sum(self.recent_steps) / len(self.recent_steps) if self.recent_steps else 0.1
        raise AdmissionError(f"engine overloaded: {why}; retry later",
                             retry_after=max(1.0, round(step * waiting / max(1, cfg.max_num_seqs))))

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        req.record(QUEUED)
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues (abort or finish) and give back its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.record(PREEMPTED)
        self.num_preemptions += 1
        self.preemptions_by_bucket[victim.bucket] = self.preemptions_by_bucket.get(victim.bucket, 0) + 1
        out.preempted.append(victim)
        self.add(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=Request.sort_key)
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                budget -= num_new

        now = time.monotonic()
        for req in [r for r in self.waiting if r.deadline is not None and r.deadline < now]:
            self.waiting.remove(req)
            self.kv.free(req)
            out.expired.append(req)

        # No admissions in a step that had to preempt: the pool is already short.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits, num_cached = self.kv.computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate(req, num_new, hits):
                break
            self.waiting.pop(0)
            if req.first(SCHEDULED) is None:
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            req.status = Status.RUNNING
            req.record(SCHEDULED)
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
        return out
