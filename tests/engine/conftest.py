"""Shared fixtures: the embedded model's directory, a transformers reference, the prompts."""
from __future__ import annotations

import pytest
import torch

from slofleet.engine import loader

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "List three prime numbers.",
    "Who wrote Pride and Prejudice? Answer with the author's full name and one fact about the book.",
    "Translate 'good morning' into Spanish.",
    "Describe a cat to someone who has never seen one, in a friendly tone, with at least three details "
    "about how it moves, sounds and behaves around people at home.",
    "Hi",
]


@pytest.fixture(scope="session")
def model_dir():
    return loader.resolve("default")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return loader.load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def chat_ids(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]


class Reference:
    """transformers' own greedy generate() on the same weights, fp32, one prompt at a time (no padding)."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.cache: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}

    def greedy(self, ids: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
        key = (tuple(ids), max_new)
        if key not in self.cache:
            with torch.inference_mode():
                out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                          output_scores=True, return_dict_in_generate=True, pad_token_id=2)
            toks = out.sequences[0, len(ids):].tolist()
            lps = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
            self.cache[key] = (toks, lps)
        return self.cache[key]


@pytest.fixture(scope="session")
def reference(model_dir):
    return Reference(model_dir)


def assert_matches_reference(ours: list[int], our_lps: list[dict[int, float]], ref: list[int],
                             ref_lps: list[torch.Tensor]) -> None:
    """Token-for-token equality, except one near-tie: at the first divergence each token must be in the
    other's top-5 and the two log-probabilities within 1e-3; the comparison stops there."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        ref_top5 = torch.topk(ref_lps[i], 5).indices.tolist()
        ours_top5 = sorted(our_lps[i], key=our_lps[i].get, reverse=True)[:5]
        gap = abs(float(ref_lps[i][a]) - float(ref_lps[i][b]))
        assert a in ref_top5 and b in ours_top5 and gap < 1e-3, (
            f"diverged at token {i}: ours {a}, transformers {b} (log-prob gap {gap:.2e}); "
            f"ours={ours[:i + 1]} ref={ref[:i + 1]}")
        return
    assert len(ours) == len(ref), f"lengths differ: ours {len(ours)}, transformers {len(ref)}"
