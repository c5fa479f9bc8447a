"""Replica profiles: how long one engine step takes, and how much KV one replica holds.

step_s = step + prefill_token * prompt_tokens + decode_seq * decoding_seqs + kv_token * kv_tokens_attended
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

CPU_PROFILE = Path(__file__).parent / "data" / "cpu_profile.json"  # written by benchmarks/profile_cpu.py


@dataclass(frozen=True)
class Profile:
    name: str
    step_s: float
    prefill_token_s: float
    decode_seq_s: float
    kv_token_s: float
    token_budget: int  # max_num_batched_tokens: prefill chunk + decodes per step
    max_batch: int
    kv_tokens: int
    cold_start_s: float
    source: str = ""

    def prefill_alone_s(self, prompt: float) -> float:
        """A lone request's prefill: one step per budget-sized chunk."""
        chunks = -(-prompt // self.token_budget)
        return chunks * self.step_s + prompt * self.prefill_token_s

    def rates(self, mean_prompt: float, mean_output: float, tpot_s: float) -> tuple[float, float]:
        """(prompt tokens/s if only prefilling, tokens/s if only decoding) at the TPOT target.

        With chunked prefill a replica shares each second between prefill (prefill_token_s per token) and
        decode steps; at rate r: r*p*prefill_token_s + r*o*(decode_seq_s + kv_token_s*ctx) <= 1 - step_s/tpot,
        where ctx = p + o/2 is a decoding request's mean context. The two terms are the capacities returned.
        """
        free = max(1.0 - self.step_s / tpot_s, 0.05)
        per_token = self.decode_seq_s + self.kv_token_s * (mean_prompt + mean_output / 2)
        return free / self.prefill_token_s, free / per_token

    def capacity(self, mean_prompt: float, mean_output: float, tpot_s: float) -> float:
        """Requests/s one replica sustains at the TPOT target for this mix."""
        pre, dec = self.rates(mean_prompt, mean_output, tpot_s)
        return 1.0 / (mean_prompt / pre + mean_output / dec)


# Llama-3.1-8B, bf16, one H100 SXM 80 GB, vLLM-style engine. From published figures:
# - weights 16 GB read once per decode step at 3.35 TB/s HBM -> ~4.8 ms; measured vLLM batch-1 ITL on
#   H100 for 8B models is ~6-7 ms, so 7 ms per step including scheduling and sampling;
# - KV cache 128 KiB/token (32 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes) read per decode step:
#   131072 B / 3.35 TB/s = 39 ns per KV token;
# - prefill ~16 GFLOP/token (2 x 8B params) at ~40% of the 989 dense bf16 TFLOPS -> ~40 us/token
#   (~25k prompt tokens/s, in line with published vLLM/SGLang prefill throughput for 8B on H100);
# - per-sequence decode overhead (sampling, detokenization, metadata) ~0.05 ms;
# - KV pool: 80 GB x 0.9 - 16 GB weights - ~4 GB activations = 52 GB / 128 KiB ~ 400k tokens;
# - cold start ~90 s: pod scheduling, image already cached on the node, weights from local NVMe, CUDA graphs.
GPU = Profile("gpu-h100-llama8b", step_s=0.007, prefill_token_s=40e-6, decode_seq_s=0.05e-3, kv_token_s=39e-9,
              token_budget=2048, max_batch=256, kv_tokens=400_000, cold_start_s=90.0,
              source="published H100 figures for an 8B model (see profiles.py)")


def load(name: str) -> Profile:
    """'gpu', 'cpu' (the measured data/cpu_profile.json) or a path to a profile JSON."""
    if name == "gpu":
        return GPU
    path = CPU_PROFILE if name == "cpu" else Path(name)
    data = json.loads(path.read_text())
    keep = {f.name for f in fields(Profile)}
    return Profile(**{k: v for k, v in data.items() if k in keep})


def validation(name: str = "cpu") -> dict | None:
    """The measured load mix stored beside a profile (arrivals, TTFT/TPOT P50) when there is one."""
    path = CPU_PROFILE if name == "cpu" else Path(name)
    return json.loads(path.read_text()).get("validation") if path.exists() else None
