"""The in-place paged decode-attention kernel (paged_attention.cpp) against the torch gather path, and its fallback."""
from __future__ import annotations

import pytest
import torch

from slofleet.engine import paged_kernel
from slofleet.engine.attention import TorchAttention
from tests.kernels.test_attention import make_batch

pytestmark = pytest.mark.skipif(paged_kernel.load() is None, reason="no C++ compiler here to build the kernel")

SPANS = [(1, 300), (1, 1), (1, 17), (5, 300), (1, 33), (17, 40), (20, 60), (33, 33), (4, 4), (1, 129)]


def attend(spans, block_size, heads, kv_heads, dim, dtype, kernel: bool, monkeypatch, seed=0):
    meta, k_cache, v_cache = make_batch(spans, block_size, kv_heads, dim, dtype, seed)
    total = sum(q for q, _ in spans)
    gen = torch.Generator().manual_seed(seed + 7)
    # q as a view of the fused q/k rotation's output, as model.py passes it (rows strided past the K heads)
    qk = torch.randn((total, heads + kv_heads, dim), generator=gen).to(dtype)
    q, k = qk[:, :heads], qk[:, heads:]
    v = torch.randn((total, kv_heads, dim), generator=gen).to(dtype)
    with monkeypatch.context() as m:
        if not kernel:
            m.setattr(paged_kernel, "usable", lambda *a: False)
        return TorchAttention(block_size).forward(q, k, v, k_cache, v_cache, meta, dim ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (12, 1, 64), (6, 2, 80)])
def test_kernel_matches_the_gather_path(dtype, block_size, heads, kv_heads, dim, monkeypatch):
    """Decodes, drafts (a few queries over a cache), prompts and prefill chunks in one batch; AVX-512 templates
    (head dims 64 and 128, groups up to 8) and the plain loops (a group of 12, head dim 80) alike."""
    assert paged_kernel.usable(torch.zeros(1, heads, dim, dtype=dtype),
                               torch.zeros(1, block_size, kv_heads, dim, dtype=dtype))
    got = attend(SPANS, block_size, heads, kv_heads, dim, dtype, True, monkeypatch, seed=block_size + heads)
    want = attend(SPANS, block_size, heads, kv_heads, dim, dtype, False, monkeypatch, seed=block_size + heads)
    # bf16: both round the same fp32-accumulated result once; an ulp apart at most
    atol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


def test_shapes_it_does_not_take_go_to_torch():
    q = torch.zeros(2, 8, 64)
    assert not paged_kernel.usable(q.half(), torch.zeros(1, 16, 2, 64).half())  # fp16: the torch path
    assert not paged_kernel.usable(q, torch.zeros(1, 16, 2, 64).bfloat16())  # mixed dtypes
    assert not paged_kernel.usable(torch.zeros(2, 8, 512), torch.zeros(1, 16, 2, 512))  # head dim over 256
    assert not paged_kernel.usable(torch.zeros(2, 8, 64)[..., ::2], torch.zeros(1, 16, 2, 32))  # strided head dim


def test_without_a_compiler_the_engine_keeps_the_torch_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLOFLEET_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    paged_kernel.load.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="slofleet.engine.kernel"):
            assert paged_kernel.load() is None
        assert "using the torch path" in caplog.text
        assert not paged_kernel.usable(torch.zeros(1, 9, 64), torch.zeros(1, 16, 3, 64))
        assert not list(tmp_path.rglob("*.so"))
    finally:
        paged_kernel.load.cache_clear()
