"""DecodeGraphs: copy in, pad, replay, slice out. Captured for real on a GPU; on CPU replay runs eagerly."""
from __future__ import annotations

import torch
from transformers import LlamaConfig

from slofleet.engine.backends.torch import TorchAttention, TorchOps
from slofleet.engine.backends.triton.attention import TritonAttention
from slofleet.engine.backends.triton.cuda_graphs import DecodeGraphs, _Captured, default_sizes, maybe_capture
from slofleet.engine.model import CausalLM

from .test_attention import DEVICE, make_batch


class EagerReplay:
    """Stands in for torch.cuda.CUDAGraph: replay re-runs the captured forward into the same output buffer."""

    def __init__(self, fn, out: torch.Tensor):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def test_default_sizes():
    assert default_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and default_sizes(256)[-1] == 256
    assert default_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_padded_replay_matches_eager_torch():
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    triton_attn, torch_attn = TritonAttention(16), TorchAttention(16)
    ops = TorchOps(16, triton_attn)
    model = CausalLM(cfg, ops, 256).to(DEVICE).eval()
    model.rotary.to(torch.device(DEVICE))
    spans = [(1, 40), (1, 17), (1, 64)]
    meta, kc, vc = make_batch(spans, 16, 2, 16, torch.float32, seed=5)
    kv = [(kc.clone(), vc.clone()) for _ in range(2)]
    ref_kv = [(kc.clone(), vc.clone()) for _ in range(2)]
    input_ids = torch.tensor([3, 9, 27], device=DEVICE)
    positions = torch.tensor([s - 1 for _, s in spans], device=DEVICE)

    graphs = DecodeGraphs(model, kv, max_batch=4, max_blocks=4, max_seq_len=64, device=torch.device(DEVICE),
                          sizes=[2, 4])
    if DEVICE == "cuda":
        graphs.capture()
    else:
        assert maybe_capture(model, kv, triton_attn, 4, 4, 64, torch.device("cpu")) is None  # off on CPU
        with torch.inference_mode():
            for size in graphs.sizes:
                out = graphs._forward(size)
                graphs.graphs[size] = _Captured(EagerReplay(lambda s=size: graphs._forward(s), out), out)
    with torch.inference_mode():
        assert graphs.can_run(meta)
        logits = graphs.run(input_ids, positions, meta).clone()
        ops.attention = torch_attn
        ref = model(input_ids, positions, ref_kv, meta, torch.arange(3, device=DEVICE))
    assert logits.shape == (3, 64)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    written = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=DEVICE)
    written[meta.slot_mapping] = True
    for (k, v), (rk, _) in zip(kv, ref_kv):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        for new, old in ((k, kc), (v, vc)):  # the padding row wrote nothing
            assert torch.equal(new.view(-1, 2, 16)[~written], old.view(-1, 2, 16)[~written])
    meta.max_query_len = 2
    assert not graphs.can_run(meta)
