"""The engine core: requests in, one scheduled step at a time, token/text deltas out.

Thread-safe at its edges: `add_request` and `abort` may be called from another thread (the API server)
while `step` runs in the engine thread; both only append to inboxes that `step` drains.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from . import loader
from .config import EngineConfig, cpu_quota_threads
from .detokenizer import Detokenizer
from .kv_cache_manager import KVCacheManager
from .kv_transfer import KVPayload
from .request import FINISHED, FIRST_TOKEN, SCHEDULED, Request, Status
from .runner import ModelRunner
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import AdmissionError, Scheduler, SchedulerOutput  # noqa: F401 (AdmissionError re-exported)

log = logging.getLogger("slofleet.engine")
_ids = itertools.count()


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    request: Request
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    kv: KVPayload | None = None  # prefill role: the exported prompt KV, on the finishing output


@dataclass
class StepStats:
    steps: int = 0
    tokens_scheduled: int = 0
    max_tokens_in_step: int = 0
    prompt_tokens_computed: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        torch.set_num_threads(config.num_threads or cpu_quota_threads())
        t0 = time.monotonic()
        path = loader.resolve(config.model)
        self.model_name = config.served_model_name or loader.model_name(config.model)
        self.tokenizer = loader.load_tokenizer(path)
        hf_config = loader.load_config(path)
        self.max_model_len = min(config.max_model_len, loader.max_positions(hf_config),
                                 getattr(hf_config, "sliding_window", None) or 1 << 30)
        self.runner = ModelRunner(config, path, self.max_model_len)
        num_blocks = config.num_blocks or max(1, int(config.kv_cache_memory_gb * 2**30) // self.runner.bytes_per_block())
        self.runner.allocate_kv(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        eos = getattr(hf_config, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.sampler = Sampler(self.eos_ids, config.seed)
        self.bucket_priorities = config.bucket_priority_map()
        self.requests: dict[str, Request] = {}
        self.detok: dict[str, Detokenizer] = {}
        self.inbox: deque[Request] = deque()
        self.aborts: deque[str] = deque()
        self.stats = StepStats()
        log.info("engine ready: model=%s dtype=%s device=%s blocks=%d x %d tokens, %.1fs", self.model_name,
                 str(self.runner.dtype).removeprefix("torch."), self.runner.device, num_blocks, config.block_size,
                 time.monotonic() - t0)

    # -- requests in ---------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        vocab = self.runner.hf_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int | None = None, bucket: str = "default", deadline_s: float | None = None,
                    export_kv: bool = False, kv: KVPayload | None = None) -> Request:
        """Validate and queue a request. ValueError: bad input (400); AdmissionError: overloaded (429).
        export_kv: stop after the first token and attach the prompt's KV (prefill role).
        kv: continue from another engine's prefill instead of computing the prompt (decode role)."""
        params = params or SamplingParams()
        if kv is not None:
            if kv.block_size != self.config.block_size or kv.k.shape[0] != self.runner.num_layers:
                raise ValueError(f"KV payload has block size {kv.block_size} and {kv.k.shape[0]} layers; this "
                                 f"engine uses {self.config.block_size} and {self.runner.num_layers}")
            prompt = kv.prompt_token_ids
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                             "tokens, and at least one must be left to generate: shorten the prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds the "
                             f"context of {self.max_model_len} tokens: ask for at most {room}")
        max_tokens = params.max_tokens or room
        if self.kv.blocks_needed(len(ids) + max_tokens) > self.kv.pool.num_blocks:
            raise ValueError(f"prompt + max_tokens need {len(ids) + max_tokens} tokens of KV cache; this engine "
                             f"holds {self.kv.pool.num_blocks * self.config.block_size}: lower max_tokens")
        pending = list(self.inbox)
        self.scheduler.check_admission(len(ids), len(pending), sum(r.num_prompt_tokens for r in pending))
        if priority is None:
            priority = self.bucket_priorities.get(bucket, 0)
        req = Request(request_id or f"req-{next(_ids)}", ids, params, 1 if export_kv else max_tokens, priority,
                      bucket, None if deadline_s is None else time.monotonic() + deadline_s, export_kv=export_kv,
                      imported=kv)
        self.inbox.append(req)
        return req

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.inbox or self.aborts or self.scheduler.has_work())

    # -- one step ------------------------------------------------------------------------
    def _drain_inboxes(self) -> list[RequestOutput]:
        out = []
        while self.inbox:
            req = self.inbox[0]
            if req.imported is not None and not self.kv.allocate(req, req.num_prompt_tokens):
                break  # the pool is full: import when blocks free up, keeping arrival order
            self.inbox.popleft()
            self.requests[req.request_id] = req
            self.detok[req.request_id] = Detokenizer(self.tokenizer, req.params.stop, req.params.include_stop_str_in_output)
            if req.imported is not None:
                out += self._import(req)
            if not req.finished:
                self.scheduler.add(req)
        while self.aborts:
            req = self.requests.get(self.aborts.popleft())
            if req is not None and not req.finished:
                out.append(self._finish(req, "abort", [], "", []))
        return out

    def _import(self, req: Request) -> list[RequestOutput]:
        """Load a prefill engine's KV into this request's blocks, then emit the token it sampled."""
        payload: KVPayload = req.imported
        req.imported = None  # the tensors are copied into the pool; don't keep them alive
        table = self.kv.block_table(req.request_id)
        n = payload.num_blocks
        if n != len(table) or payload.block_hashes != [h.hex() for h in req.block_hashes[:len(payload.block_hashes)]]:
            log.error("request %s: KV payload does not match its prompt tokens; refused", req.request_id)
            return [self._finish(req, "error", [], "", [])]
        self.runner.write_kv(table, payload.k, payload.v)
        req.num_computed_tokens = req.num_prompt_tokens
        req.record(SCHEDULED)
        return self._postprocess([req], [payload.first_token], [payload.first_logprobs])

    def _finish(self, req: Request, reason: str, new_ids: list[int], new_text: str, new_lp: list) -> RequestOutput:
        kv = None
        if req.export_kv and reason != "abort":
            k, v = self.runner.read_kv(self.kv.block_table(req.request_id))
            n_full = req.num_prompt_tokens // self.config.block_size
            kv = KVPayload(req.prompt_token_ids, req.output_token_ids[0], req.output_logprobs[0] if
                           req.output_logprobs else None, [h.hex() for h in req.block_hashes[:n_full]],
                           self.config.block_size, k[:, :self.kv.blocks_needed(req.num_prompt_tokens)],
                           v[:, :self.kv.blocks_needed(req.num_prompt_tokens)])
        self.scheduler.remove(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        req.record(FINISHED)
        self.requests.pop(req.request_id, None)
        self.detok.pop(req.request_id, None)
        self.sampler.forget(req.request_id)
        return RequestOutput(req.request_id, new_ids, new_text, True, reason, req, new_lp, kv)

    def _stop_reason(self, req: Request, token: int, stop_hit: bool) -> str | None:
        p = req.params
        n = len(req.output_token_ids)
        if stop_hit:
            return "stop"
        if n >= p.min_tokens and (token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)):
            return "stop"
        if n >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inboxes()
        t0 = time.monotonic()
        sched: SchedulerOutput = self.scheduler.schedule()
        outputs += [self._finish(r, "deadline", [], "", []) for r in sched.expired]
        if not sched.scheduled:
            return outputs
        batch = [(req, n, self.kv.block_table(req.request_id)) for req, n in sched.scheduled]
        logits = self.runner.execute(batch)
        self.stats.steps += 1
        self.stats.tokens_scheduled += sched.num_tokens
        self.stats.max_tokens_in_step = max(self.stats.max_tokens_in_step, sched.num_tokens)
        for req, n in sched.scheduled:
            self.stats.prompt_tokens_computed += max(0, min(req.num_prompt_tokens, req.num_computed_tokens + n)
                                                     - req.num_computed_tokens)
            req.num_computed_tokens += n
        # A request samples once all its tokens are computed; a partial prefill chunk does not.
        rows = [i for i, (req, _) in enumerate(sched.scheduled) if req.num_computed_tokens >= req.num_tokens]
        if rows:
            reqs = [sched.scheduled[i][0] for i in rows]
            tokens, logprobs = self.sampler.sample(logits[rows], reqs)
            outputs += self._postprocess(reqs, tokens, logprobs)
        self.scheduler.recent_steps.append(time.monotonic() - t0)
        return outputs

    def _postprocess(self, reqs: list[Request], tokens: list[int], logprobs: list) -> list[RequestOutput]:
        outputs = []
        for req, tok, lp in zip(reqs, tokens, logprobs):
            if not req.output_token_ids and req.first(FIRST_TOKEN) is None:
                req.record(FIRST_TOKEN)
            req.output_token_ids.append(tok)
            new_lp = [lp] if lp is not None else []
            if lp is not None:
                req.output_logprobs.append(lp)
            detok = self.detok[req.request_id]
            is_special = tok in self.eos_ids and not req.params.ignore_eos
            text, stop_hit = detok.add(tok) if not is_special else ("", False)
            reason = self._stop_reason(req, tok, stop_hit)
            if reason is None:
                outputs.append(RequestOutput(req.request_id, [tok], text, False, None, req, new_lp))
                continue
            if not stop_hit:
                text += detok.flush()
            outputs.append(self._finish(req, reason, [tok], text, new_lp))
        return outputs

    def text_of(self, req: Request) -> str:
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
