"""Sampler and detokenizer behaviour."""
from __future__ import annotations

import pytest
import torch

from slofleet.engine.detokenizer import Detokenizer
from slofleet.engine.request import Request
from slofleet.engine.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    apply_penalties,
    block_stop_tokens,
    filter_top_k_top_p,
)
from slofleet.engine.sampling_params import SamplingParams

V = 10


def make(params: SamplingParams, out: list[int] = (), prompt: list[int] = (0,), rid: str = "r") -> Request:
    r = Request(request_id=rid, prompt_token_ids=list(prompt), params=params, max_tokens=100)
    r.output_token_ids = list(out)
    return r


def logits(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_picks_argmax():
    s = Sampler(eos_ids={9})
    toks, _ = s.sample(logits([0, 1, 5, 2, 0, 0, 0, 0, 0, 0]), [make(SamplingParams(temperature=0))])
    assert toks == [2]


def kept(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> list[bool]:
    """Which tokens of one row of logits survive the filters."""
    vals, ids = filter_top_k_top_p(x[None], torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    ids = torch.arange(len(x))[None] if ids is None else ids
    return torch.zeros(len(x), dtype=torch.bool).index_fill_(0, ids[torch.isfinite(vals)], True).tolist()


def test_the_runners_logits_are_sampled_in_place():
    with torch.inference_mode():  # as the runner makes them
        made = logits([0.0, 5.0, 1.0], [2.0, 0.0, 0.0])
    reqs = [make(SamplingParams(temperature=0.7, repetition_penalty=1.2), out=[1]),
            make(SamplingParams(temperature=0), rid="g")]
    assert len(Sampler(eos_ids=set()).sample(made[:1], reqs[:1])[0]) == 1  # every row random: no copy is made
    assert len(Sampler(eos_ids=set()).sample(made, reqs)[0]) == 2


def test_top_k_and_top_p_restrict_support():
    x = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert kept(x, 2, 1.0, 0.0) == [True, True, False, False, False]
    probs = x.softmax(-1)  # ~[.64, .24, .09, .03, .01]
    assert kept(x, -1, 0.8, 0.0) == [True, True, False, False, False] and probs[0] < 0.8 < probs[:2].sum()
    assert kept(x, -1, 1.0, 0.2) == [True, True, False, False, False]
    assert kept(x, 3, 0.7, 0.0) == [True, True, False, False, False]  # top-p over what top-k leaves: .67, .25, .09


def test_top_p_beyond_the_candidates_sorts_the_whole_row():
    x = torch.zeros(3 * TOP_P_CANDIDATES)  # flat: top_p just under 0.5 needs half of the vocabulary
    assert sum(kept(x, -1, 0.499, 0.0)) == len(x) // 2


def test_a_mixed_batch_samples_each_row_from_its_own_distribution():
    torch.manual_seed(0)
    row = torch.randn(V) * 2
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(top_k=3),
              SamplingParams(top_p=0.6), SamplingParams(min_p=0.3, temperature=1.5)]
    n = 4000  # rows of each setting, interleaved in one batch
    reqs = [make(params[i % len(params)], rid=str(i)) for i in range(n * len(params))]
    toks, _ = Sampler(eos_ids=set()).sample(row.repeat(len(reqs), 1), reqs)
    counts = torch.zeros(len(params), V).index_put_(
        (torch.arange(len(reqs)) % len(params), torch.tensor(toks)), torch.ones(len(reqs)), accumulate=True)
    for i, p in enumerate(params):
        if p.greedy:
            expected = torch.nn.functional.one_hot(row.argmax(), V).float()
        else:
            vals, ids = filter_top_k_top_p(row[None] / p.temperature, torch.tensor([p.top_k]),
                                           torch.tensor([p.top_p]), torch.tensor([p.min_p]))
            probs = vals.softmax(-1)[0]
            expected = torch.zeros(V).index_add_(0, torch.arange(V) if ids is None else ids[0], probs)
        assert (counts[i] / n - expected).abs().max() < 0.03, (p, counts[i] / n, expected)


def test_seed_makes_sampling_reproducible_and_independent_of_batch():
    row = torch.randn(V)
    p = SamplingParams(temperature=1.0, seed=123)
    draws = []
    for _ in range(2):
        s = Sampler(eos_ids=set())
        r = make(p)
        draws.append([s.sample(row[None].clone(), [r])[0][0] for _ in range(20)])
    assert draws[0] == draws[1]
    s = Sampler(eos_ids=set())  # same seed, now batched beside an unseeded request
    r, other = make(p, rid="a"), make(SamplingParams(temperature=1.0), rid="b")
    batched = [s.sample(torch.stack([row, row]), [r, other])[0][0] for _ in range(20)]
    assert batched == draws[0]
    assert len(set(draws[0])) > 1  # really sampling, not argmax


def test_penalties():
    base = [1.0, 1.0, 1.0, 1.0]
    s = Sampler(eos_ids=set())
    # token 0 generated 3 times: frequency penalty pushes it below the others
    toks, _ = s.sample(logits([1.5, 1.0, 0.0, 0.0]),
                       [make(SamplingParams(temperature=0, frequency_penalty=0.5), out=[0, 0, 0])])
    assert toks == [1]
    toks, _ = s.sample(logits([1.2, 1.0, 0.0, 0.0]),
                       [make(SamplingParams(temperature=0, presence_penalty=0.5), out=[0])])
    assert toks == [1]
    # repetition penalty also covers prompt tokens
    toks, _ = s.sample(logits([2.0, 1.5, 0.0, 0.0]),
                       [make(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0])])
    assert toks == [1]
    assert base == [1.0] * 4


def test_penalties_and_min_tokens_in_a_batch_apply_to_their_own_rows():
    torch.manual_seed(1)
    x = torch.randn(4, V)
    reqs = [make(SamplingParams(temperature=0, repetition_penalty=1.7), prompt=[1, 2], out=[3, 3]),
            make(SamplingParams(temperature=0)),
            make(SamplingParams(temperature=0, frequency_penalty=0.4, presence_penalty=-0.3), out=[5, 5, 6]),
            make(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7]), out=[1])]
    batched = x.clone()
    apply_penalties(batched, reqs)
    block_stop_tokens(batched, reqs, eos_ids={8})
    expected = x.clone()
    for t in (1, 2, 3):
        expected[0, t] = expected[0, t] / 1.7 if expected[0, t] > 0 else expected[0, t] * 1.7
    expected[2, 5] -= 0.4 * 2 - 0.3
    expected[2, 6] -= 0.4 - 0.3
    expected[3, [7, 8]] = float("-inf")
    assert torch.allclose(batched, expected)


def test_min_tokens_blocks_eos_and_stop_ids():
    s = Sampler(eos_ids={0})
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    toks, _ = s.sample(logits([5.0, 4.0, 1.0]), [make(p, out=[2])])
    assert toks == [2]
    toks, _ = s.sample(logits([5.0, 4.0, 1.0]), [make(p, out=[2, 2])])
    assert toks == [0]


def test_logprobs_are_raw_top_n():
    s = Sampler(eos_ids=set())
    toks, lps = s.sample(logits([3.0, 2.0, 1.0, 0.0]), [make(SamplingParams(temperature=0, logprobs=2))])
    ref = torch.log_softmax(torch.tensor([3.0, 2.0, 1.0, 0.0]), -1)
    assert set(lps[0]) == {0, 1} and lps[0][0] == pytest.approx(float(ref[0]))


@pytest.mark.parametrize("kwargs, msg", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=1.5), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=50), "logprobs"), (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_bad_params_are_refused(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def test_detokenizer_is_utf8_safe_and_holds_partial_stops(tokenizer):
    text = "Café ☕ naïve — 日本語 end"
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = Detokenizer(tokenizer)
    pieces = [d.add(t)[0] for t in ids]
    assert "".join(pieces) + d.flush() == text
    assert not any("\ufffd" in p for p in pieces)
    d = Detokenizer(tokenizer, stop=["naïve"])
    out, hit = "", False
    for t in ids:
        piece, hit = d.add(t)
        out += piece
        assert "na" not in out  # a prefix of the stop string is never released
        if hit:
            break
    assert hit and out == "Café ☕ "
