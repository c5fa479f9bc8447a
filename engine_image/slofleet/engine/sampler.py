"""Turn the last-position logits of a batch into next tokens, one row per request."""
from __future__ import annotations

import torch

from .request import Request

NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Presence/frequency penalties on generated tokens (OpenAI), repetition penalty on prompt+output (HF/vLLM)."""
    for row, req in enumerate(reqs):
        p = req.params
        if p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1.0:
            continue
        x = logits[row]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.token_ids())), dtype=torch.long, device=x.device)
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(req.output_token_ids, dtype=torch.long, device=x.device)
            counts = torch.zeros_like(x).index_add_(0, ids, torch.ones_like(ids, dtype=x.dtype))
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def block_stop_tokens(logits: torch.Tensor, reqs: list[Request], eos_ids: set[int]) -> None:
    """Before min_tokens are out, EOS and stop token ids cannot be sampled."""
    for row, req in enumerate(reqs):
        if len(req.output_token_ids) < req.params.min_tokens:
            banned = set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else eos_ids)
            if banned:
                logits[row, sorted(banned)] = NEG_INF


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, NEG_INF))
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), NEG_INF)
    return logits


class Sampler:
    def __init__(self, eos_ids: set[int], seed: int = 0):
        self.eos_ids = eos_ids
        self.default_generator = torch.Generator().manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.default_generator
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = torch.Generator().manual_seed(req.params.seed)
        return gen

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict[int, float] | None]]:
        """Next token per row, and the top-N log-probabilities (of the model's raw distribution) where asked."""
        logits = logits.float().cpu()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in reqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        apply_penalties(logits, reqs)
        block_stop_tokens(logits, reqs, self.eos_ids)
        tokens: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        greedy = logits.argmax(dim=-1).tolist()
        for row, req in enumerate(reqs):
            p = req.params
            if p.greedy:
                tok = greedy[row]
            else:
                x = filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p, p.min_p)
                tok = int(torch.multinomial(x.softmax(-1), 1, generator=self._generator(req)))
            tokens.append(tok)
            if p.logprobs is not None and raw_logprobs is not None:
                lp = raw_logprobs[row]
                top = torch.topk(lp, p.logprobs) if p.logprobs else None
                entry = {tok: float(lp[tok])}
                if top is not None:
                    entry.update(zip(top.indices.tolist(), top.values.tolist()))
                logprobs.append(entry)
            else:
                logprobs.append(None)
        return tokens, logprobs
