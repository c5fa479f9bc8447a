"""Each supported family: our forward over the paged cache vs transformers on a tiny random checkpoint."""
from __future__ import annotations

import pytest
import torch

from slofleet.engine.config import EngineConfig
from slofleet.engine.request import Request
from slofleet.engine.runner import ModelRunner
from slofleet.engine.sampling_params import SamplingParams

COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def families():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    return {
        "llama": LlamaConfig(**COMMON, tie_word_embeddings=False),
        "llama3-rope-tied": LlamaConfig(**COMMON, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**COMMON),
        "mistral": MistralConfig(**COMMON, sliding_window=None),
    }


@pytest.mark.parametrize("family", ["llama", "llama3-rope-tied", "qwen2", "mistral"])
def test_logits_match_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(families()[family]).float().eval()
    hf.save_pretrained(tmp_path)
    runner = ModelRunner(EngineConfig(dtype="float32", block_size=8), tmp_path, max_len=256)
    runner.allocate_kv(16)
    ids = torch.randint(0, 257, (2, 37)).tolist()
    with torch.inference_mode():
        ref = torch.stack([hf(torch.tensor([x])).logits[0] for x in ids])  # [2, 37, V]
    # Ours: both prompts in one flat batch, split into a prefill chunk then single-token decodes,
    # so the cached-context paths of the attention are exercised too.
    reqs = [Request(request_id=f"r{i}", prompt_token_ids=x, params=SamplingParams(), max_tokens=1)
            for i, x in enumerate(ids)]
    tables = [[0, 1, 2, 3, 4], [7, 6, 5, 9, 8]]
    got = [[None] * 37 for _ in reqs]
    chunks = [30, 1, 1, 1, 1, 1, 1, 1]
    for n in chunks:
        batch = [(r, n, t) for r, t in zip(reqs, tables)]
        input_ids, positions, meta, rows = runner.prepare(batch)
        all_rows = torch.arange(len(input_ids))
        with torch.inference_mode():
            out = runner.model(input_ids, positions, runner.kv_caches, meta, all_rows)
        for j, (r, _, _) in enumerate(batch):
            start = int(meta.query_start_loc[j])
            for k in range(n):
                got[j][r.num_computed_tokens + k] = out[start + k]
        for r in reqs:
            r.num_computed_tokens += n
    ours = torch.stack([torch.stack(g) for g in got])
    assert (ours - ref).abs().max().item() < 1e-4
