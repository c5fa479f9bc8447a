"""Speculative decoding without a second model: prompt-lookup (n-gram) drafts, verified in one step.

A decoding request whose last n tokens occurred earlier in its own prompt + output gets the k tokens that followed
that occurrence as a draft. The step feeds its last token and the draft (1 + k query tokens, like a short prefill
chunk over its paged KV) and the model's logits at every one of them; the longest prefix of the draft that the
sampler agrees with is accepted, plus the token sampled after it. Repetitive text (quoting, summarising, editing
code) then yields several tokens per forward pass. A request's next draft is at most one token longer than what
it kept of its last one (up to k): rejected draft tokens are compute spent for nothing.

Only greedy rows without penalties draft, once min_tokens are out: their choice at each position is the argmax of
the model's own logits whatever came before, so accepting while argmax equals the draft gives exactly the tokens
speculation off would. (Sampled rows would need the rejection-sampling rule; they decode one token a step.)
"""
from __future__ import annotations

import array
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import Request

# Every change to a request's draft is made here: proposed (Speculator.propose), cut to what a step has room for
# (fit), dropped (drop: preempted), verified (Speculator.accept) and settled (Speculator.settle).


def propose(tokens: list[int], n: int, k: int) -> list[int]:
    """The (up to) k tokens that followed the latest earlier occurrence of tokens' last n; [] when there is none.
    Searched as bytes (rfind runs in C): a Python scan of a long context per request per step would cost more
    than the step saves."""
    if len(tokens) <= n or k < 1:
        return []
    raw, width = array.array("i", tokens).tobytes(), array.array("i").itemsize
    tail, end = raw[-n * width:], len(raw) - width  # a match must end before the last token
    while (at := raw.rfind(tail, 0, end)) >= 0:
        if at % width == 0:  # on a token boundary, not inside two tokens' bytes
            start = at // width + n
            return tokens[start:start + k]
        end = at + len(tail) - 1
    return []


def can_draft(req: Request) -> bool:
    p = req.params
    return (p.greedy and p.structured is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and len(req.output_token_ids) >= p.min_tokens)


def fit(scheduled: list[tuple[Request, int]], budget: int, kv: KVCacheManager) -> int:
    """Give the decodes just scheduled their drafts from what the decodes left: budget, and blocks that are free (a
    draft never preempts anyone); each entry of scheduled grows to 1 + its draft. The budget left."""
    for i, (req, _) in enumerate(scheduled):
        k = min(len(req.draft), budget)
        if k and kv.allocate(req, 1, lookahead=k):
            req.draft, scheduled[i] = req.draft[:k], (req, 1 + k)
            budget -= k
        else:
            req.draft = []
    return budget


def drop(req: Request) -> None:
    """A preempted request's draft: its KV is gone, so it is proposed afresh once it decodes again."""
    req.draft = []


@dataclass(slots=True, kw_only=True)
class SpecStats:
    """Cumulative per-bucket counters: draft tokens verified, how many were accepted, and drafts verified (so
    tokens per drafted step = 1 + accepted / drafts)."""
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    drafts: dict[str, int] = field(default_factory=dict)

    def copy(self) -> SpecStats:
        return SpecStats(drafted=dict(self.drafted), accepted=dict(self.accepted), drafts=dict(self.drafts))

    def add(self, bucket: str, drafted: int, accepted: int) -> None:
        self.drafted[bucket] = self.drafted.get(bucket, 0) + drafted
        self.accepted[bucket] = self.accepted.get(bucket, 0) + accepted
        self.drafts[bucket] = self.drafts.get(bucket, 0) + 1


class Speculator:
    def __init__(self, num_tokens: int, ngram: int, buckets: str = ""):
        self.k, self.n = num_tokens, ngram
        self.buckets = {b.strip() for b in buckets.split(",") if b.strip()}  # empty: every bucket
        self.stats = SpecStats()

    def propose(self, running: list[Request]) -> None:
        """Set every running request's draft for the coming step ([] where it does not draft)."""
        if not self.k:
            return  # off: drafts stay [] (the scheduler and _preempt only ever shorten them)
        for req in running:
            room = req.max_tokens - len(req.output_token_ids) - 1  # the bonus token is always one of them
            ok = (room > 0 and req.num_tokens - req.num_computed_tokens == 1 and can_draft(req)
                  and (not self.buckets or req.bucket in self.buckets))
            req.draft = propose(req.token_ids(), self.n, min(req.draft_len or self.k, room)) if ok else []

    @staticmethod
    def rows(scheduled: list[tuple[Request, int]]) -> tuple[list[int], list[Request]]:
        """The logits rows to sample (the runner returns 1 + len(draft) per request) and their requests: every
        row of a request whose tokens are all computed; none of a partial prefill chunk."""
        rows: list[int] = []
        reqs: list[Request] = []
        at = 0
        for req, _ in scheduled:
            width = 1 + len(req.draft)
            if req.num_computed_tokens >= req.num_tokens:
                rows += range(at, at + width)
                reqs += [req] * width
            at += width
        return rows, reqs

    def accept(self, reqs: list[Request], tokens: list[int], logprobs: list
               ) -> tuple[list[Request], list[list[int]], list[list]]:
        """Per request, the sampled tokens it keeps: those matching its draft, then the one after them."""
        out_reqs, out_tokens, out_lps, i = [], [], [], 0
        while i < len(reqs):
            req = reqs[i]
            draft, picked = req.draft, tokens[i:i + 1 + len(req.draft)]
            ok = next((j for j, (d, t) in enumerate(zip(draft, picked)) if d != t), len(draft))
            if draft:
                self.stats.add(req.bucket, len(draft), ok)
                req.draft_len = min(self.k, ok + 1)
            out_reqs.append(req)
            out_tokens.append(picked[:ok + 1])
            out_lps.append(logprobs[i:i + ok + 1])
            i += 1 + len(draft)
        return out_reqs, out_tokens, out_lps

    @staticmethod
    def settle(kv: KVCacheManager, reqs: list[Request]) -> None:
        """After the step's tokens are appended, for each drafted request still running: the accepted drafts' KV
        counts as computed (all but the bonus token), the slots of the rejected ones roll back."""
        for req in reqs:
            if req.draft and not req.finished:
                start, req.num_computed_tokens = req.num_computed_tokens, req.num_tokens - 1
                kv.rollback(req, start)
            req.draft = []
