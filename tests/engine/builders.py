"""Builders for scheduler tests without a model (in the style of vLLM's tests/v1/core/utils.py): a scheduler
over a real KV-cache manager, requests of a given prompt length, and a step that stands in for the forward
pass and the sampler, so queue order, budgets and block accounting are checked in milliseconds."""
from __future__ import annotations

import itertools
import time

from slofleet.engine.config import EngineConfig
from slofleet.engine.kv_cache_manager import KVCacheManager
from slofleet.engine.request import Request, Status
from slofleet.engine.sampling_params import SamplingParams
from slofleet.engine.scheduler import Scheduler, SchedulerOutput

_ids = itertools.count()


def make_scheduler(num_blocks: int = 64, block_size: int = 16, max_num_batched_tokens: int = 512,
                   max_num_seqs: int = 64, **config) -> Scheduler:
    """What LLMEngine builds around its model: the config, the KV-cache manager over num_blocks, the scheduler."""
    cfg = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                       max_num_seqs=max_num_seqs, **config)
    return Scheduler(cfg, KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching))


def make_request(prompt: int | list[int], max_tokens: int = 3, priority: int = 0, bucket: str = "default",
                 deadline_s: float | None = None, request_id: str | None = None, tpot: float | None = None) -> Request:
    """prompt: a length (tokens no other request shares, so no prefix-cache hits) or the token ids themselves."""
    n = next(_ids)
    ids = list(range(n * 100_000, n * 100_000 + prompt)) if isinstance(prompt, int) else list(prompt)
    return Request(request_id=request_id or f"r{n}", prompt_token_ids=ids,
                   params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                   max_tokens=max_tokens, priority=priority, bucket=bucket, tpot=tpot,
                   deadline=None if deadline_s is None else time.monotonic() + deadline_s)


def finish(sched: Scheduler, req: Request) -> None:
    sched.remove(req)
    req.status = Status.FINISHED


def step(sched: Scheduler, token: int = 0) -> tuple[SchedulerOutput, list[tuple[str, str]]]:
    """One LLMEngine.step with a stand-in model that samples `token`: (the schedule, (id, finish reason) of the
    requests that finished in it). A request samples once all its tokens are computed and stops at max_tokens."""
    out = sched.schedule()
    done = []
    for req in out.expired:
        finish(sched, req)
        done.append((req.request_id, "deadline"))
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens < req.num_tokens:
            continue  # a prefill chunk short of the prompt's end samples nothing
        req.output_token_ids.append(token)
        if len(req.output_token_ids) >= req.max_tokens:
            finish(sched, req)
            done.append((req.request_id, "length"))
    return out, done


def run(sched: Scheduler, max_steps: int = 10_000) -> tuple[list[tuple[str, str]], list[SchedulerOutput]]:
    """Step until nothing is left: (id, finish reason) in the order requests finished, and every step's schedule."""
    done, outs = [], []
    for _ in range(max_steps):
        if not sched.has_work():
            return done, outs
        out, finished = step(sched)
        done += finished
        outs.append(out)
    raise AssertionError(f"still working after {max_steps} steps")


def drain(sched: Scheduler) -> list[str]:
    """Step until nothing is left; the request ids in the order they finished."""
    return [rid for rid, _ in run(sched)[0]]
