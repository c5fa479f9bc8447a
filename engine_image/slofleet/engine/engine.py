"""The engine core: requests in, one scheduled step at a time, token/text deltas out.

Thread-safe at its edges: `add_request` and `abort` may be called from another thread (the API server)
while `step` runs in the engine thread; both only append to inboxes that `step` drains.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from slofleet.api.contract import DEFAULT_BUCKET

from . import kv_transfer, loader
from .config import EngineConfig, cpu_quota_threads
from .detokenizer import Detokenizer
from .errors import AdmissionError, InvalidRequest
from .kv_cache_manager import KVCacheManager
from .kv_transfer import KVPayload
from .request import Event, FinishReason, Request, Status, fan_out
from .runner import ModelRunner
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .speculative import Speculator
from .stats import EngineStats, StepRecord, StepStats
from .step_cost import CALIBRATION
from .structured import Grammars

__all__ = ["AdmissionError", "LLMEngine", "RequestOutput"]
log = logging.getLogger("slofleet.engine")
_ids = itertools.count()
MAX_FAILED_STEPS = 3  # in a row: the engine itself is broken, not one request


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    request: Request
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    kv: KVPayload | None = None  # prefill role: the exported prompt KV, on the finishing output


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        torch.set_num_threads(config.num_threads or cpu_quota_threads())
        t0 = time.monotonic()
        path = loader.resolve(config.model)
        served = [n.strip() for n in config.served_model_name.split(",") if n.strip()]
        self.model_names = list(dict.fromkeys([*served, loader.model_name(config.model)]))
        self.model_name = self.model_names[0]  # reported in responses and metrics, as vLLM does
        self.tokenizer = loader.load_tokenizer(path)
        hf_config = loader.load_config(path)
        self.vocab_size = hf_config.vocab_size
        self.max_model_len = min(config.max_model_len, loader.max_positions(hf_config),
                                 getattr(hf_config, "sliding_window", None) or 1 << 30)
        self.runner = ModelRunner(config, path, self.max_model_len)
        budget = int(config.kv_cache_memory_gb * 2**30)
        num_blocks = config.num_blocks or max(1, budget // self.runner.bytes_per_block())
        self.runner.allocate_kv(num_blocks)
        self.fingerprint = loader.fingerprint(path)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, self.fingerprint)
        self.scheduler = Scheduler(config, self.kv)
        eos = getattr(hf_config, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        self.sampler = Sampler(self.eos_ids, config.seed, self.runner.ops.argmax, self.grammars)
        self.spec = Speculator(config.num_speculative_tokens, config.speculative_ngram, config.speculative_buckets)
        self.bucket_priorities, self.bucket_tpot = config.bucket_priority_map(), config.bucket_tpot_map()
        self.requests: dict[str, Request] = {}
        self.detok: dict[str, Detokenizer] = {}
        self.inbox: deque[Request] = deque()
        self.aborts: deque[str] = deque()
        self.step_stats = StepStats()
        self.failed_steps = 0  # in a row
        self.orphans: list[RequestOutput] = []  # samples that ended with the one they were to fork from
        self.last_step: StepRecord | None = None
        self.busy_since: float | None = None  # when the last step ended with work left: the next one follows at once
        if self.bucket_tpot:
            self.calibrate()
        log.info("engine ready: model=%s dtype=%s device=%s blocks=%d x %d tokens, %.1fs", self.model_name,
                 str(self.runner.dtype).removeprefix("torch."), self.runner.device, num_blocks, config.block_size,
                 time.monotonic() - t0)

    def calibrate(self) -> None:
        """Run CALIBRATION's requests (tokens no prompt shares) to completion, so the step cost is fitted before the
        first real request; the counters start from zero after it."""
        base = self.vocab_size // 2
        for i, (tokens, count) in enumerate(CALIBRATION):
            for k in range(count):
                ids = [base + (i * 97 + k * 13 + j) % (self.vocab_size - base) for j in range(tokens)]
                self.add_request(ids, SamplingParams(max_tokens=6, ignore_eos=True), request_id=f"calibrate-{i}-{k}")
            self.step()
        while self.has_unfinished():
            self.step()
        self.scheduler.cost.fit()
        self.step_stats, self.busy_since, self.last_step = StepStats(), None, None
        self.scheduler.slack = 0.0
        log.info("step cost: %s", self.scheduler.cost)

    # -- requests in ---------------------------------------------------------------------
    def check_token_ids(self, ids: list[int], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{what} out of range [0, {self.vocab_size}): {bad[:5]}")

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        self.check_token_ids(prompt, "prompt token ids")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int | None = None, bucket: str = DEFAULT_BUCKET, deadline_s: float | None = None,
                    export_kv: bool = False, kv: KVPayload | None = None, tpot: float | None = None) -> Request:
        """Validate and queue a request. InvalidRequest: bad input (400); AdmissionError: overloaded (429);
        UpstreamError: kv does not fit this engine (502).
        export_kv: stop after the first token and attach the prompt's KV (prefill role).
        kv: continue from another engine's prefill instead of computing the prompt (decode role).
        tpot: its bucket's TPOT target in seconds (default: --bucket-tpot-ms), which bounds the prompt work of steps
        it decodes in."""
        params = params or SamplingParams()
        hashes: list[bytes] = []
        if kv is not None:
            prompt = kv.prompt_token_ids
            hashes = self.kv.chain(prompt)
            kv.check(num_layers=self.runner.num_layers, kv_shape=self.runner.kv_shape, hashes=hashes)
        ids = self.tokenize(prompt)
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(list(params.logit_bias or ()), "logit_bias token ids")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                                 "tokens, and at least one must be left to generate: shorten the prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequest(f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds the "
                                 f"context of {self.max_model_len} tokens: ask for at most {room}", "max_tokens")
        max_tokens = params.max_tokens or room
        if self.kv.blocks_needed(len(ids) + max_tokens) > self.kv.pool.num_blocks:
            raise InvalidRequest(f"prompt + max_tokens need {len(ids) + max_tokens} tokens of KV cache; this engine "
                                 f"holds {self.kv.pool.num_blocks * self.config.block_size}: lower max_tokens",
                                 "max_tokens")
        pending = list(self.inbox)
        self.scheduler.check_admission(len(ids), len(pending), sum(r.num_prompt_tokens for r in pending))
        if priority is None:
            priority = self.bucket_priorities.get(bucket, 0)
        req = Request(request_id=request_id or f"req-{next(_ids)}", prompt_token_ids=ids, params=params,
                      max_tokens=1 if export_kv else max_tokens, priority=priority, bucket=bucket,
                      deadline=None if deadline_s is None else time.monotonic() + deadline_s, export_kv=export_kv,
                      imported=kv, block_hashes=hashes, tpot=self.bucket_tpot.get(bucket) if tpot is None else tpot)
        if params.n > 1 and kv is not None:  # the hand-off carries one sample's first token
            raise InvalidRequest("n > 1 cannot continue a KV hand-off: prefill it here", "n")
        if params.n > 1 and not export_kv:
            fan_out(req)
        self.inbox.append(req)
        return req

    def kv_payload_bytes(self, num_tokens: int) -> int:
        """The most a KV hand-off of num_tokens prompt tokens can weigh on the wire (header included)."""
        return self.kv.blocks_needed(num_tokens) * self.runner.bytes_per_block() + 24 * num_tokens + (64 << 10)

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.inbox or self.aborts or self.scheduler.has_work())

    def stats(self) -> EngineStats:
        """A snapshot of the engine's gauges and counters (safe to call from another thread between steps)."""
        waiting = list(self.scheduler.waiting) + list(self.inbox)
        by_bucket: dict[str, int] = {}
        for r in waiting:
            by_bucket[r.bucket] = by_bucket.get(r.bucket, 0) + 1
        pool, sched = self.kv.pool, self.scheduler
        return EngineStats(running=len(sched.running), waiting_by_bucket=by_bucket,
                           queued_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting),
                           kv_blocks_total=pool.num_blocks, kv_blocks_free=pool.num_free,
                           prefix_queries=self.kv.stats.queries, prefix_hits=self.kv.stats.hits,
                           preemptions_by_bucket=dict(sched.preemptions_by_bucket),
                           admission_refusals=sched.admission_refusals, steps=replace(self.step_stats),
                           dtype=self.runner.dtype_choice, kv_evictions=pool.evictions,
                           kv_block_bytes=self.runner.bytes_per_block(), spec=self.spec.stats.copy(),
                           kv_unfilled_slots=sum(len(self.kv.block_table(r.request_id)) * self.config.block_size
                                                 - r.num_computed_tokens for r in list(sched.running)))

    # -- one step ------------------------------------------------------------------------
    def _drain_inboxes(self) -> list[RequestOutput]:
        out = []
        while self.inbox:
            req = self.inbox[0]
            if req.imported is not None and not self.kv.allocate(req, req.num_prompt_tokens):
                break  # the pool is full: import when blocks free up, keeping arrival order
            self.inbox.popleft()
            for r in req.samples():
                self.requests[r.request_id] = r
                self.detok[r.request_id] = Detokenizer(self.tokenizer, r.params.stop,
                                                       r.params.include_stop_str_in_output,
                                                       skip_special=r.params.skip_special_tokens)
            if req.imported is not None:
                out += self._import(req)
            if not req.finished:
                self.scheduler.add(req)
        while self.aborts:
            req = self.requests.get(self.aborts.popleft())
            if req is not None and not req.finished:
                out.append(self._finish(req, FinishReason.ABORT))
        return out

    def _import(self, req: Request) -> list[RequestOutput]:
        """Load a prefill engine's KV (checked in add_request) into the request's blocks, then emit the token it
        sampled."""
        payload, req.imported = req.imported, None  # the tensors are copied into the pool; don't keep them alive
        self.runner.write_kv(self.kv.block_table(req.request_id), payload.k, payload.v)
        req.num_computed_tokens = req.num_prompt_tokens
        req.record(Event.SCHEDULED)
        return self._postprocess([req], [[payload.first_token]], [[payload.first_logprobs]])

    def _finish(self, req: Request, reason: FinishReason, tokens: list[int] | None = None, text: str = "",
                logprobs: list[dict[int, float]] | None = None) -> RequestOutput:
        kv = None
        if req.export_kv and reason in (FinishReason.STOP, FinishReason.LENGTH):  # a first token was sampled
            kv = kv_transfer.export(self.runner, self.kv.block_table(req.request_id), req)
        self.scheduler.remove(req)
        if req.parent is not None and req in req.parent.forks:  # a sample aborted before it forked
            req.parent.forks.remove(req)
        # samples still waiting for this one's prompt end with it (its KV will never be computed)
        forks, req.forks = req.forks, []
        self.orphans += [self._finish(r, reason) for r in forks]
        req.status, req.finish_reason = Status.FINISHED, reason
        req.record(Event.FINISHED)
        self.requests.pop(req.request_id, None)
        self.detok.pop(req.request_id, None)
        self.sampler.forget(req.request_id)
        return RequestOutput(request_id=req.request_id, new_token_ids=tokens or [], new_text=text, finished=True,
                             finish_reason=reason, request=req, new_logprobs=logprobs or [], kv=kv)

    def _stop_reason(self, req: Request, token: int, stop_hit: bool) -> FinishReason | None:
        p = req.params
        n = len(req.output_token_ids)
        if stop_hit:
            return FinishReason.STOP
        if n >= p.min_tokens and (token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)):
            return FinishReason.STOP
        if n >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def step(self) -> list[RequestOutput]:
        """One scheduled step. If it raises, the requests it was running fail (their state is no longer
        trustworthy) and the engine goes on; only a fault that repeats every step escapes."""
        try:
            outputs = self._step()
            self.failed_steps = 0
        except Exception:
            self.failed_steps += 1
            self.busy_since = None  # the next step is not timed from a failed one
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise
            victims = list(self.scheduler.running)
            log.exception("step failed; failing its running requests %s", [r.request_id for r in victims])
            outputs = [self._finish(r, FinishReason.ERROR) for r in victims if not r.finished]
        outputs += self.orphans
        self.orphans = []
        return outputs

    def _step(self) -> list[RequestOutput]:
        # A step that follows one with work left is timed from that one's end: the loop's own time between steps
        # (delivering outputs, metrics, waiting for the interpreter lock the HTTP thread holds) is part of every
        # stream's time per output token, so the step cost must learn it.
        t0 = self.busy_since or time.monotonic()
        outputs = self._drain_inboxes()
        self.spec.propose(self.scheduler.running)
        sched: SchedulerOutput = self.scheduler.schedule()
        outputs += [self._finish(r, FinishReason.DEADLINE) for r in sched.expired]
        if not sched.scheduled:
            self.busy_since = None
            return outputs
        batch = [(req, n, self.kv.block_table(req.request_id)) for req, n in sched.scheduled]
        logits = self.runner.execute(batch)
        work = self.scheduler.commit(sched, time.monotonic(), self.step_stats)
        # A request samples once all its tokens are computed; a partial prefill chunk does not.
        rows, reqs = self._fork(*self.spec.rows(sched.scheduled))
        kept: list[list[int]] = []
        if rows:
            whole = rows == list(range(len(logits)))  # a forked sample repeats its parent's row
            tokens, logprobs = self.sampler.sample(logits if whole else logits[rows], reqs)
            reqs, kept, kept_lps = self.spec.accept(reqs, tokens, logprobs)
            outputs += self._postprocess(reqs, kept, kept_lps)
            self.spec.settle(self.kv, reqs)
        end = time.monotonic()
        seconds, self.busy_since = end - t0, end if self.scheduler.has_work() else None
        self.scheduler.observe(len(sched.scheduled), work.prompt_tokens, seconds)
        self.last_step = StepRecord(seconds=seconds, num_tokens=sched.num_tokens, num_decodes=work.decodes,
                                    num_requests=len(sched.scheduled), num_generated=sum(map(len, kept)))
        for req, _ in sched.scheduled:  # each request's share of the step, for cost attribution
            req.busy_s += seconds / len(sched.scheduled)
        return outputs

    def _fork(self, rows: list[int], reqs: list[Request]) -> tuple[list[int], list[Request]]:
        """Samples waiting on a request whose prompt this step finished start now: they share its KV blocks and
        sample their first token from its logits row, so n samples cost one prefill."""
        for row, req in list(zip(rows, reqs)):
            if req.forks and not req.output_token_ids:
                started, copies = self.scheduler.fork(req)
                for src, dst in copies:
                    self.runner.write_kv([dst], *self.runner.read_kv([src]))
                rows, reqs = rows + [row] * len(started), reqs + started
        return rows, reqs

    def _postprocess(self, reqs: list[Request], tokens: list[list[int]], logprobs: list[list]
                     ) -> list[RequestOutput]:
        """One output per request for the tokens it produced this step (several where a draft was accepted),
        each token checked in turn: a stop ends the request there and the tokens after it are dropped."""
        outputs = []
        for req, toks, lps in zip(reqs, tokens, logprobs):
            if not req.output_token_ids and req.first(Event.FIRST_TOKEN) is None:
                req.record(Event.FIRST_TOKEN)
            detok, new, new_lps, text, reason, stop_hit = self.detok[req.request_id], [], [], "", None, False
            for tok, lp in zip(toks, lps):
                req.output_token_ids.append(tok)
                new.append(tok)
                if lp is not None:
                    req.output_logprobs.append(lp)
                    new_lps.append(lp)
                is_special = tok in self.eos_ids and not req.params.ignore_eos
                piece, stop_hit = detok.add(tok) if not is_special else ("", False)
                text += piece
                if (reason := self._stop_reason(req, tok, stop_hit)) is not None:
                    break
            if reason is None:
                outputs.append(RequestOutput(request_id=req.request_id, new_token_ids=new, new_text=text,
                                             finished=False, finish_reason=None, request=req, new_logprobs=new_lps))
                continue
            if not stop_hit:
                text += detok.flush()
            outputs.append(self._finish(req, reason, new, text, new_lps))
        return outputs
