"""Offline API: `LLM().generate(prompts, SamplingParams(...))`, as vLLM users know it."""
from __future__ import annotations

from dataclasses import dataclass

from .config import EngineConfig
from .engine import LLMEngine
from .sampling_params import SamplingParams

# Offline generation has no latency target, so a step may take more prompt tokens than the server's default (as vLLM's
# LLM class does): fewer, longer prefill steps reuse each weight over more rows (docs/kernels-notes.md).
OFFLINE_BATCHED_TOKENS = 2048


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    index: int = 0  # which of the prompt's n samples


class LLM:
    def __init__(self, model: str = "default", **kwargs):
        kwargs.setdefault("max_num_batched_tokens", OFFLINE_BATCHED_TOKENS)
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run every prompt to completion together (continuous batching); outputs in prompt order, and a prompt
        with SamplingParams.n > 1 has its n samples one after another (index 0 to n - 1)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        reqs = [s for p, sp in zip(prompts, plist) for s in self.engine.add_request(p, sp).samples()]
        texts = {r.request_id: [] for r in reqs}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                texts[out.request_id].append(out.new_text)
        return [CompletionOutput(r.prompt_token_ids, list(r.output_token_ids), "".join(texts[r.request_id]),
                                 r.finish_reason, r.output_logprobs if r.params.logprobs is not None else None,
                                 r.sample_index)
                for r in reqs]
