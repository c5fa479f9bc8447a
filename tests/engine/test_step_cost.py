"""The step-cost model: the fit recovers a step's fixed, per-sequence and per-prompt-token costs from noisy steps,
keeps its per-token cost through decode-only windows, and bounds the prompt tokens a step may add."""
from __future__ import annotations

import random

import pytest

from slofleet.engine.step_cost import WINDOW, StepCost


def steps(cost: StepCost, n: int, rng: random.Random, prompt: bool = True) -> None:
    for _ in range(n):
        s, p = rng.randint(1, 48), rng.choice([0, 0, rng.randint(16, 512)]) if prompt else 0
        cost.observe(s + (p > 0), p, (0.012 + 0.0015 * (s + (p > 0)) + 0.0004 * p) * rng.uniform(0.95, 1.05))


def test_the_fit_recovers_the_costs_and_bounds_the_prompt_work():
    cost, rng = StepCost(), random.Random(0)
    assert cost.prompt_budget(10, 0.05) is None  # nothing learnt: no bound
    steps(cost, WINDOW, rng)
    assert cost.fixed == pytest.approx(0.012, abs=0.004)
    assert cost.per_seq == pytest.approx(0.0015, rel=0.15) and cost.per_token == pytest.approx(0.0004, rel=0.1)
    budget = cost.prompt_budget(11, 0.05)  # ten decodes and the chunk's own row, within 50 ms
    assert budget == pytest.approx((0.05 - 0.012 - 0.0015 * 11) / 0.0004, rel=0.15)
    assert cost.predict(11, budget) <= 0.05 + 1e-9 < cost.predict(11, budget + 5)
    assert cost.prompt_budget(40, 0.05) == 0  # the decodes alone take the whole target


def test_a_decode_only_window_keeps_the_per_token_cost():
    cost, rng = StepCost(), random.Random(1)
    steps(cost, WINDOW, rng)
    learnt = cost.per_token
    steps(cost, 2 * WINDOW, rng, prompt=False)
    assert cost.fitted and cost.per_token == pytest.approx(learnt, rel=0.05)
    assert cost.per_seq == pytest.approx(0.0015, rel=0.15)
