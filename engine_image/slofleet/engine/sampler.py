"""Turn the last-position logits of a batch into next tokens, one row per request.

One tensor path for the whole batch, whatever mix of settings it holds: temperature, top-k, top-p and min-p are
per-row tensors, and each row samples by inverse CDF from one uniform number (cumulative weights, then a binary
search), so a seeded row draws a single number from its own generator and the other rows share one batched draw:
a request's samples depend on its seed only, never on what it is batched with. Top-k/top-p look at the
TOP_P_CANDIDATES most likely tokens (a top-k, far cheaper than sorting the vocabulary), then at 8 times as many,
and sort whole rows only when those still hold less than top_p of the mass. Python loops run only over the rows
that need something (penalties, min_tokens, seeds, logprobs); an all-greedy batch costs one max.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .request import Request
from .structured import Grammars

NEG_INF = float("-inf")
TOP_P_CANDIDATES = 256


def _pairs(rows: list[int], ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row, token id) index tensors for indexing and index_put_."""
    r = torch.tensor(rows).repeat_interleave(torch.tensor([len(t) for t in ids]))
    return r, torch.tensor([t for toks in ids for t in toks], dtype=torch.long)


def _unique_cells(logits: torch.Tensor, rows: list[int], ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct cells (row * vocab + id) of logits named by rows/ids, and how often each is named."""
    r, t = _pairs(rows, ids)
    return torch.unique(r * logits.shape[1] + t, return_counts=True)


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Presence/frequency penalties on generated tokens (OpenAI), repetition penalty on prompt+output (HF/vLLM).
    Only the cells of seen tokens are read and written, never whole rows."""
    flat = logits.view(-1)
    rep = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
    if rep:
        cells, _ = _unique_cells(logits, rep, [reqs[i].token_ids() for i in rep])
        pen = torch.ones(len(reqs))
        pen[rep] = torch.tensor([float(reqs[i].params.repetition_penalty) for i in rep])
        vals, pen = flat[cells], pen[cells // logits.shape[1]]
        flat[cells] = torch.where(vals > 0, vals / pen, vals * pen)
    freq = [i for i, r in enumerate(reqs)
            if r.output_token_ids and (r.params.presence_penalty or r.params.frequency_penalty)]
    if freq:
        cells, counts = _unique_cells(logits, freq, [reqs[i].output_token_ids for i in freq])
        fp = torch.zeros(len(reqs), 2)
        fp[freq] = torch.tensor([[float(reqs[i].params.frequency_penalty), float(reqs[i].params.presence_penalty)]
                                 for i in freq])
        fp = fp[cells // logits.shape[1]]
        flat.index_add_(0, cells, -(fp[:, 0] * counts + fp[:, 1]))


def apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
    """OpenAI's logit_bias: each listed token's logit moves by its bias (-100 bans it, +100 all but forces it)."""
    rows = [i for i, r in enumerate(reqs) if r.params.logit_bias]
    if rows:
        maps = [reqs[i].params.logit_bias for i in rows]
        biases = torch.tensor([b for m in maps for b in m.values()], dtype=logits.dtype)
        logits.index_put_(_pairs(rows, [list(m) for m in maps]), biases, accumulate=True)


def block_stop_tokens(logits: torch.Tensor, reqs: list[Request], eos_ids: set[int]) -> None:
    """Before min_tokens are out, EOS and stop token ids cannot be sampled; except under a constraint, whose grammar
    says when the output may end (blocking its only allowed token would force one it forbids)."""
    rows = [i for i, r in enumerate(reqs)
            if len(r.output_token_ids) < r.params.min_tokens and r.params.structured is None]
    banned = [sorted(set(reqs[i].params.stop_token_ids) | (set() if reqs[i].params.ignore_eos else eos_ids))
              for i in rows]
    if any(banned):
        logits.index_put_(_pairs(rows, banned), torch.tensor(NEG_INF))


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Candidate logits [n, K] (the dropped ones -inf) and their token ids (None: the whole row, in order) for rows
    of logits [n, V] with per-row top_k (<= 0: off), top_p and min_p. Every row must restrict (top-k or top-p) or
    none: the candidates of a restricting row are a prefix of its sorted vocabulary. Top-p applies to what top-k
    leaves, min-p (relative to the most likely token, which renormalising does not change) to what both leave."""
    vocab = logits.shape[1]
    k_on, p_on = top_k > 0, top_p < 1
    vals, ids = logits, None
    if bool(k_on.any() | p_on.any()):
        first = int(torch.where(k_on, top_k, TOP_P_CANDIDATES).max())
        for size in (min(vocab, first), min(vocab, 8 * first), vocab):
            vals, ids = torch.topk(logits, size) if size < vocab else torch.sort(logits, descending=True)
            kth = vals.gather(1, torch.where(k_on, top_k.clamp(max=size), size)[:, None] - 1)
            vals = vals.masked_fill(vals < kth, NEG_INF)  # ties with the k-th stay, as in vLLM
            # top-k rows renormalise over what they keep (all among the candidates), the others over the whole row
            probs = (vals - torch.where(k_on, vals.logsumexp(-1), logits.logsumexp(-1))[:, None]).exp()
            if size == vocab or bool(((probs.sum(-1) >= top_p) | ~p_on).all()):
                break
        before = probs.cumsum(-1) - probs  # the mass ahead of each candidate: keep the smallest prefix reaching p
        vals = vals.masked_fill(before >= top_p[:, None], NEG_INF)
    if bool((min_p > 0).any()):
        vals = vals.masked_fill((vals - vals.amax(-1, keepdim=True)).exp() < min_p[:, None], NEG_INF)
    return vals, ids


def plain_greedy(req: Request) -> bool:
    """Whether the request's next token is its logits' argmax and nothing more: greedy, no log-probabilities, no
    penalties, no stop token held back by min_tokens."""
    p = req.params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and not p.logit_bias and len(req.output_token_ids) >= p.min_tokens)


def first_max(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, in the logits' own dtype (widening is exact, so the same index), on their device, so
    only the indices travel. A backend may do it faster (Ops.argmax: the CPU's one-pass kernel)."""
    return logits.max(-1).indices.cpu()


class Sampler:
    def __init__(self, eos_ids: set[int], seed: int = 0, argmax: Callable[[torch.Tensor], torch.Tensor] = first_max,
                 grammars: Grammars | None = None):
        self.eos_ids = eos_ids
        self.grammars = grammars  # structured outputs (structured.py); None: constrained requests fail
        self.argmax = argmax  # the backend's, picked once at load
        self.default_generator = torch.Generator().manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.forget(request_id)

    def _uniforms(self, reqs: list[Request]) -> torch.Tensor:
        u = torch.rand(len(reqs), generator=self.default_generator)
        for row, req in enumerate(reqs):
            if req.params.seed is not None:
                gen = self.generators.get(req.request_id)
                if gen is None:
                    gen = self.generators[req.request_id] = torch.Generator().manual_seed(req.params.seed)
                u[row] = torch.rand(1, generator=gen)
        return u

    def _random(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Sampled tokens [n] for rows that are not greedy; logits is scaled in place."""
        p = [r.params for r in reqs]
        logits.div_(torch.tensor([x.temperature for x in p])[:, None])
        top_k, top_p = torch.tensor([x.top_k for x in p]), torch.tensor([x.top_p for x in p])
        min_p = torch.tensor([x.min_p for x in p])
        u = self._uniforms(reqs)
        out = torch.empty(len(reqs), dtype=torch.long)
        restricts = (top_k > 0) | (top_p < 1)
        for group in (restricts, ~restricts):  # candidates for the rows that restrict, whole rows for the others
            rows = group.nonzero().squeeze(1)
            if len(rows) == 0:
                continue
            whole = len(rows) == len(reqs)
            vals, ids = filter_top_k_top_p(logits if whole else logits[rows], top_k[rows], top_p[rows], min_p[rows])
            cdf = (vals - vals.amax(-1, keepdim=True)).exp_().cumsum(-1)
            # the first token whose cumulative weight reaches a point in (0, total]: never one of weight zero
            pick = torch.searchsorted(cdf, ((1 - u[rows]) * cdf[:, -1])[:, None])
            out[rows] = (pick if ids is None else ids.gather(1, pick)).squeeze(1)
        return out

    def _greedy_constrained(self, logits: torch.Tensor, reqs: list[Request], rows: list[int], toks: list[int]
                            ) -> None:
        """In an all-greedy batch, the constrained rows' tokens: their rows alone are copied to float32 on the CPU
        and masked, the free rows keep the backend's argmax."""
        sub = logits[rows].float().cpu().contiguous()
        picked = [reqs[i] for i in rows]
        self.grammars.mask(sub, list(range(len(rows))), picked)
        best = sub.max(-1).indices.tolist()
        for i, t in zip(rows, best):
            toks[i] = t
        self.grammars.advance(picked, best)

    @torch.inference_mode()  # the runner's logits are inference tensors, changed in place here without a copy
    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict[int, float] | None]]:
        """Next token per row, and the top-N log-probabilities (of the model's raw distribution) where asked.
        The logits are the sampler's to change: penalties and temperature are applied in place."""
        constrained = [i for i, r in enumerate(reqs) if r.params.structured is not None]
        if all(plain_greedy(r) for r in reqs):
            toks = self.argmax(logits).tolist()
            if constrained:
                self._greedy_constrained(logits, reqs, constrained, toks)
            return toks, [None] * len(reqs)
        logits = logits.float().cpu().contiguous()
        want_lp = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None
        apply_logit_bias(logits, reqs)
        if constrained:  # after the raw log-probabilities, which report the model's own distribution
            self.grammars.mask(logits, constrained, [reqs[i] for i in constrained])
        apply_penalties(logits, reqs)
        block_stop_tokens(logits, reqs, self.eos_ids)
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(rand) == len(reqs):
            tokens = self._random(logits, reqs)
        else:
            tokens = logits.max(-1).indices  # the first maximum, like argmax, and several times faster on the CPU
            if rand:
                tokens[rand] = self._random(logits[rand], [reqs[i] for i in rand])
        toks = tokens.tolist()
        if constrained:
            self.grammars.advance([reqs[i] for i in constrained], [toks[i] for i in constrained])
        logprobs: list[dict[int, float] | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            top_v, top_i = torch.topk(raw_logprobs, max(reqs[i].params.logprobs for i in want_lp))
            chosen = raw_logprobs.gather(1, torch.tensor([[toks[i]] for i in want_lp])).squeeze(1).tolist()
            for i, c, v, t in zip(want_lp, chosen, top_v.tolist(), top_i.tolist()):
                k = reqs[i].params.logprobs
                logprobs[i] = {toks[i]: c, **dict(zip(t[:k], v[:k]))}
        return toks, logprobs
