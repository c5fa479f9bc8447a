"""Iteration-level scheduling: one token budget per step shared by decodes and prefill chunks.

B_{t+1} = (B_t minus finished) plus admitted. Decodes are served first (one token each), then prompt work
(chunks of running prefills and new admissions) in (priority, deadline, arrival) order while budget,
sequence slots and blocks last, never mixing prompt work of two priorities in one step; a prompt larger
than the remaining budget is prefilled in chunks. When the KV pool runs short the lowest-priority running
request is preempted (blocks freed, recomputed later). Where buckets have TPOT targets, the prompt work a step adds
is bounded by what the engine's fitted step cost (step_cost.py) says fits in the tightest target of its decodes,
with the time earlier steps left unused (slack): a TPOT target is a mean over a stream's tokens, so a prompt too
big for one step's room waits a step and takes two steps' room in the next.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from . import speculative
from .config import EngineConfig
from .errors import AdmissionError
from .kv_cache_manager import KVCacheManager
from .request import Event, Request, Status
from .stats import StepStats
from .step_cost import StepCost

STARVATION_S = 10.0  # see schedule(): the longest a request waits behind more urgent ones
MIN_PROMPT_CHUNK = 32  # prompt tokens a step adds where the cost is not yet fitted or its decodes alone overrun
TPOT_SHARE = 0.9  # of a TPOT target that a step may fill: the rest absorbs the fit's error and the streaming's jitter
SLACK_TARGETS = 0.5  # slack kept, in targets: one step may run to (1 + this) x its share when earlier ones ran short


@dataclass(slots=True, kw_only=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)
    preempted: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)  # waited past their deadline

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(slots=True, kw_only=True)
class StepWork:
    """What a step computed, as the step-cost model and the step record count it."""
    prompt_tokens: int  # prompt tokens, and draft tokens, which cost what a prompt token does
    decodes: int  # requests that decoded (their next token, and a draft where they had one)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []
        self.preemptions_by_bucket: dict[str, int] = {}
        self.admission_refusals = 0
        self.recent_steps: deque[float] = deque(maxlen=32)  # step durations, for Retry-After
        self.cost = StepCost()
        self.slack = 0.0  # seconds the targeted decodes' steps ran under their share lately (negative: over)
        self.step_target: float | None = None  # the tightest TPOT target of the scheduled step's decodes
        self.decode_s: float | None = None  # a moving mean of the targeted steps without prompt work

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
        req.record(Event.QUEUED)
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues (abort or finish) and give back its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def fork(self, parent: Request) -> tuple[list[Request], list[tuple[int, int]]]:
        """Start the samples waiting on parent, whose prompt is now computed: each shares its KV blocks and runs
        from the same point. Returns those started and the (source, destination) blocks to copy; a sample the pool
        has no block for is queued instead, to compute its prompt (from the prefix cache) like any request."""
        started, copies = [], []
        for child in parent.forks:
            moved = self.kv.fork(parent, child)
            if moved is None:
                self.add(child)
                continue
            copies += moved
            child.num_computed_tokens = child.num_cached_tokens = parent.num_computed_tokens
            child.status = Status.RUNNING
            child.record(Event.SCHEDULED)
            self.running.append(child)
            started.append(child)
        parent.forks = []
        return started, copies

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def observe(self, seqs: int, prompt_tokens: int, seconds: float) -> None:
        """A step's size and duration: for Retry-After, the step-cost model and the slack."""
        self.recent_steps.append(seconds)
        self.cost.observe(seqs, prompt_tokens, seconds)
        target = self.step_target
        if target is None:
            self.slack = 0.0  # nobody's TPOT to keep: no debt, no credit
            return
        self.slack = min(SLACK_TARGETS * target, max(-target, self.slack + TPOT_SHARE * target - seconds))
        # What the decodes alone take, as measured (the step less its prompt work at the fitted per-token cost):
        # the fit's fixed part lags a change of load, and a start under load can leave it far off.
        own = seconds - self.cost.per_token * prompt_tokens
        self.decode_s = own if self.decode_s is None else self.decode_s + (own - self.decode_s) / 4

    def prompt_budget(self, budget: int, decodes: list[Request]) -> int:
        """The step's budget left for prompt work, bounded so the step ends within TPOT_SHARE of the tightest TPOT
        target of its decodes, plus the slack. MIN_PROMPT_CHUNK where the cost is not fitted yet or the decodes
        alone overrun the target (it cannot hold: prompts still make progress). What the decodes take is measured
        (decode_s) once targeted steps ran, else the fit's."""
        targets = [r.tpot for r in decodes if r.tpot is not None]
        self.step_target = min(targets) if targets else None
        if not targets:
            return budget
        drafted = sum(len(r.draft) for r in decodes)  # already in the step, at a prompt token's cost each
        share, cost = TPOT_SHARE * self.step_target, self.cost
        if not cost.fitted:
            return min(budget, MIN_PROMPT_CHUNK)
        decode = cost.predict(len(decodes), drafted) if self.decode_s is None else (
            self.decode_s + cost.per_token * drafted)
        if decode > share:
            return min(budget, MIN_PROMPT_CHUNK)
        room = share + self.slack - decode - cost.per_seq  # the per_seq: the prompt's own row
        return min(budget, max(0, int(room / cost.per_token)))

    # -- one step ------------------------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        speculative.drop(victim)
        victim.record(Event.PREEMPTED)
        self.preemptions_by_bucket[victim.bucket] = self.preemptions_by_bucket.get(victim.bucket, 0) + 1
        out.preempted.append(victim)
        self.add(victim)

    def _reserve(self, req: Request, num_new: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Blocks for a running request, preempting the lowest-priority running request not yet scheduled
        in this step (possibly req itself) while the pool is short."""
        while not self.kv.allocate(req, num_new):
            victims = [r for r in self.running if id(r) not in scheduled]
            if not victims:
                return False
            victim = victims[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        out.scheduled.append((req, num_new))
        scheduled.add(id(req))
        return True

    def _admit(self, req: Request, budget: int, out: SchedulerOutput, scheduled: set[int]) -> int:
        """Start a waiting request (prefix-cache hits first); tokens scheduled, 0 when blocks are short."""
        # An imported request already holds blocks for its whole prompt (KV hand-off).
        hits, num_cached = ([], req.num_computed_tokens) if req.num_computed_tokens else self.kv.computed_blocks(req)
        num_new = min(req.num_tokens - num_cached, budget)
        if not self.kv.allocate(req, num_new, hits):
            return 0
        self.waiting.remove(req)
        if req.first(Event.SCHEDULED) is None:
            req.num_cached_tokens = num_cached
        req.num_computed_tokens = num_cached
        req.status = Status.RUNNING
        req.record(Event.SCHEDULED)
        self.running.append(req)
        out.scheduled.append((req, num_new))
        scheduled.add(id(req))
        return num_new

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: set[int] = set()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=Request.sort_key)
        # 1. Decodes first, one token each: a running stream's TPOT never waits behind someone's prompt.
        for req in [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]:
            if budget == 0:
                break
            if req in self.running and self._reserve(req, 1, out, scheduled):
                budget -= 1
        budget = speculative.fit(out.scheduled, budget, self.kv)

        budget = self.prompt_budget(budget, [r for r, _ in out.scheduled])
        now = time.monotonic()
        for req in [r for r in self.waiting if r.deadline is not None and r.deadline < now]:
            self.waiting.remove(req)
            self.kv.free(req)
            out.expired.append(req)

        # 2. Prompt work — chunks of running prefills and new admissions — in one (priority, deadline,
        # arrival) order, so a chat arriving during a long document's prefill goes ahead of its next chunk.
        # A step's length is what its most urgent prompt waits for, so prompt work of a less urgent priority
        # never shares a step with it: a chat's prefill is not stretched by a document's next chunk.
        # A request left waiting STARVATION_S (a steady flow of more urgent ones) is treated as most urgent, so
        # every request is served in bounded time whatever its priority.
        partial = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        urgent: tuple | None = None

        def rank(r: Request) -> tuple:
            return (r.status is not Status.WAITING or now - r.arrival_time < STARVATION_S, r.priority)

        for req in sorted(partial + self.waiting, key=lambda r: (*rank(r), *r.sort_key()[1:])):
            if budget == 0 or (urgent is not None and rank(req) > urgent):
                break
            if req.status is Status.RUNNING:
                if req in self.running:
                    num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                    if self._reserve(req, num_new, out, scheduled):
                        budget -= num_new
                        urgent = rank(req)
                continue
            # No admissions in a step that had to preempt: the pool is already short.
            if out.preempted or len(self.running) >= self.config.max_num_seqs:
                continue
            admitted = self._admit(req, budget, out, scheduled)
            if not admitted:
                break  # head of line: a lower-priority request must not take the blocks it waits for
            budget -= admitted
            urgent = rank(req)
        return out

    def commit(self, out: SchedulerOutput, t_forward: float, stats: StepStats) -> StepWork:
        """After the step's forward pass (ended at t_forward): what each scheduled request has computed. A draft's
        tokens count once accepted (speculative.settle)."""
        stats.steps += 1
        stats.tokens_scheduled += out.num_tokens
        stats.max_tokens_in_step = max(stats.max_tokens_in_step, out.num_tokens)
        work = StepWork(prompt_tokens=0, decodes=0)
        for req, n in out.scheduled:
            drafted = len(req.draft)
            prompt = max(0, min(req.num_prompt_tokens, req.num_computed_tokens + n) - req.num_computed_tokens)
            work.prompt_tokens += prompt + drafted
            work.decodes += n == 1 + drafted
            stats.prompt_tokens_computed += prompt
            req.num_prompt_computed += prompt
            if prompt:
                req.record(Event.PREFILL_CHUNK, t_forward)
            req.num_computed_tokens += n - drafted
        return work
