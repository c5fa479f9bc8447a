"""Immutable snapshots of the engine's counters and gauges: what `/metrics` and tests read, taken between steps."""
from __future__ import annotations

from dataclasses import dataclass

from .backends.cpu.dtype_probe import DtypeChoice
from .speculative import SpecStats


@dataclass(slots=True, kw_only=True)
class StepStats:
    """Cumulative step figures, updated by the engine thread."""
    steps: int = 0
    tokens_scheduled: int = 0
    max_tokens_in_step: int = 0
    prompt_tokens_computed: int = 0  # recompute included; cache hits and imported KV excluded


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One step, for the per-step histograms (batch size, tokens per step)."""
    seconds: float
    num_tokens: int
    num_decodes: int
    num_requests: int
    num_generated: int = 0  # tokens the step's requests kept (several per drafted request where drafts matched)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    running: int
    waiting_by_bucket: dict[str, int]  # requests queued or not yet drained from the inbox
    queued_prompt_tokens: int  # tokens of those requests not yet computed
    kv_blocks_total: int
    kv_blocks_free: int  # cached blocks with no reference count as free
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int
    preemptions_by_bucket: dict[str, int]
    admission_refusals: int
    steps: StepStats
    dtype: DtypeChoice  # what --dtype resolved to, and the probe's figures behind it
    kv_evictions: int  # cached blocks evicted to make room
    kv_block_bytes: int  # K and V of one block over all layers
    kv_unfilled_slots: int  # token slots allocated to running requests but not yet filled (fragmentation)
    spec: SpecStats  # speculative decoding's per-bucket draft and acceptance counters

    @property
    def waiting(self) -> int:
        return sum(self.waiting_by_bucket.values())

    @property
    def preemptions(self) -> int:
        return sum(self.preemptions_by_bucket.values())

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total
