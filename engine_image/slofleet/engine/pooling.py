"""Embeddings from the generative model, as vLLM's pooling runner gives them: the last hidden state (after the final
norm) averaged over the input's positions and L2-normalised.

The input runs through the model on KV blocks of its own, allocated for the call and dropped after it, so pooling
never takes blocks from generation or enters the prefix cache; the caller runs it on the engine's thread, between
steps."""
from __future__ import annotations

import torch

from .request import Request
from .sampling_params import SamplingParams


@torch.inference_mode()
def embed(runner, token_ids: list[int]) -> list[float]:
    """The normalised mean-pooled last hidden state of token_ids (a ModelRunner's model), as floats."""
    num_blocks = -(-len(token_ids) // runner.block_size)
    caches = [(torch.zeros((num_blocks, *runner.kv_shape), dtype=runner.dtype, device=runner.device),
               torch.zeros((num_blocks, *runner.kv_shape), dtype=runner.dtype, device=runner.device))
              for _ in range(runner.num_layers)]
    req = Request(request_id="pool", prompt_token_ids=token_ids, params=SamplingParams(), max_tokens=1)
    input_ids, positions, meta, _ = runner.prepare([(req, len(token_ids), list(range(num_blocks)))])
    hidden = runner.model.hidden(input_ids, positions, caches, meta)
    return torch.nn.functional.normalize(hidden.float().mean(0), dim=0).cpu().tolist()
