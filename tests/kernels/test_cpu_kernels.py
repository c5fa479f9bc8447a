"""The CPU kernels against the torch ops they replace: paged decode and prefill attention (paged_attention.cpp,
prefill_attention.cpp), the fused residual add + RMSNorm and rotary embedding (fused_ops.cpp), the fp32 and bf16
GEMMs (small_gemm.cpp, tile_gemm.cpp, dot_gemm.cpp); and the fallback without a compiler."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slofleet.engine.backends.cpu import cpu_kernels, dtype_probe
from slofleet.engine.backends.cpu.attention import CpuAttention
from slofleet.engine.backends.cpu.ops import CpuOps
from slofleet.engine.backends.torch import TorchAttention, TorchOps
from slofleet.engine.model import RMSNorm, Rotary
from tests.kernels.test_attention import make_batch

# Skipped only without a compiler: where there is one, a build that fails is a bug (the engine would fall back to the
# torch ops in silence), and these tests fail on it.
pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C++ compiler here to build the kernels")

SPANS = [(1, 300), (1, 1), (1, 17), (5, 300), (1, 33), (17, 40), (20, 60), (33, 33), (4, 4), (1, 129)]
# prefill chunks past one query block (48 rows a tile on AVX-512, 24 on AVX2) and one key tile, fresh and over a cache
LONG_SPANS = [(300, 300), (100, 400), (64, 200), (1, 50), (49, 49), (250, 251)]


def attend(spans, block_size, heads, kv_heads, dim, dtype, kernel: bool, monkeypatch, seed=0):
    meta, k_cache, v_cache = make_batch(spans, block_size, kv_heads, dim, dtype, seed)
    total = sum(q for q, _ in spans)
    gen = torch.Generator().manual_seed(seed + 7)
    # q as a view of the fused q/k rotation's output, as model.py passes it (rows strided past the K heads)
    qk = torch.randn((total, heads + kv_heads, dim), generator=gen).to(dtype)
    q, k = qk[:, :heads], qk[:, heads:]
    v = torch.randn((total, kv_heads, dim), generator=gen).to(dtype)
    backend = CpuAttention(block_size) if kernel else TorchAttention(block_size)
    return backend.forward(q, k, v, k_cache, v_cache, meta, dim ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (12, 1, 64), (6, 2, 80)])
def test_kernel_matches_the_gather_path(dtype, block_size, heads, kv_heads, dim, monkeypatch):
    """Decodes, drafts (a few queries over a cache), prompts and prefill chunks in one batch; the vector templates
    (AVX-512 or AVX2, whichever this CPU has: head dims 64 and 128, groups up to 8) and the plain loops (a group of
    12, head dim 80) alike."""
    assert cpu_kernels.attention_usable(torch.zeros(1, heads, dim, dtype=dtype),
                               torch.zeros(1, block_size, kv_heads, dim, dtype=dtype))
    got = attend(SPANS, block_size, heads, kv_heads, dim, dtype, True, monkeypatch, seed=block_size + heads)
    want = attend(SPANS, block_size, heads, kv_heads, dim, dtype, False, monkeypatch, seed=block_size + heads)
    # bf16: both round the same fp32-accumulated result once; an ulp apart at most
    atol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128)])
def test_slots_past_a_context_never_reach_the_output(dtype, heads, kv_heads, dim):
    """A block's slots past its row's context may hold anything (a freed request's K/V, or NaN): decodes and drafts,
    odd and even context lengths (the bf16 kernel takes V two keys at a time), answer as over a zeroed cache."""
    spans, bs = [(1, 1), (1, 17), (3, 33), (1, 6), (2, 129)], 16
    meta, k_cache, v_cache = make_batch(spans, bs, kv_heads, dim, dtype, seed=5)
    keep = torch.zeros(k_cache.shape[0] * bs, dtype=torch.bool)
    for (q, seq), table in zip(spans, meta.block_tables.tolist()):
        keep[[table[p // bs] * bs + p % bs for p in range(seq - q)]] = True
    gen = torch.Generator().manual_seed(3)
    q = torch.randn((sum(q for q, _ in spans), heads, dim), generator=gen).to(dtype)
    k, v = (torch.randn((len(q), kv_heads, dim), generator=gen).to(dtype) for _ in range(2))
    outs = []
    for fill in (float("nan"), 0.0):
        kc, vc = (c.clone().view(-1, kv_heads, dim) for c in (k_cache, v_cache))
        kc[~keep], vc[~keep] = fill, fill
        outs.append(CpuAttention(bs).forward(q, k, v, kc.view_as(k_cache), vc.view_as(v_cache), meta, dim ** -0.5))
    assert not outs[0].isnan().any()
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


@pytest.mark.parametrize("dtype,tiles", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (6, 2, 80), (16, 1, 64)])
def test_long_prefill_chunks_match_the_torch_path(dtype, tiles, heads, kv_heads, dim, monkeypatch):
    """The prefill kernel takes head dims 64 and 128 on a vector CPU; head dim 80 stays on SDPA (checked the same).
    bf16 runs on the AMX tiles where the CPU has them (tile_attention.cpp), else on the vector unit; both checked."""
    q, cache = torch.zeros(1, heads, dim, dtype=dtype), torch.zeros(1, 16, kv_heads, dim, dtype=dtype)
    assert cpu_kernels.prefill_usable(q, cache) == (dim in (64, 128) and vector_cpu())
    if tiles and not cpu_kernels.tiles():
        pytest.skip("no AMX tiles here")
    if tiles:
        assert cpu_kernels.prefill_takes(heads, kv_heads, dim, "tile_prefill") == (dim in (64, 128))
    else:
        monkeypatch.setattr(cpu_kernels, "tiles", lambda: False)
    got = attend(LONG_SPANS, 16, heads, kv_heads, dim, dtype, True, monkeypatch, seed=dim)
    want = attend(LONG_SPANS, 16, heads, kv_heads, dim, dtype, False, monkeypatch, seed=dim)
    atol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


def vector_cpu() -> bool:
    return bool({"avx512f", "avx2"} & set(dtype_probe.cpu_model().split()))  # every AVX2 CPU has FMA too


@pytest.mark.parametrize("build", ["avx2_build", "no_bf16_dot_build", "no_amx_build"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128)])
def test_the_other_templates_match_the_gather_path_too(build, dtype, heads, kv_heads, dim, request, monkeypatch):
    other = request.getfixturevalue(build)
    monkeypatch.setattr(cpu_kernels, "load", lambda: other)
    monkeypatch.setattr(cpu_kernels, "tiles", lambda: False)  # an AVX2 CPU has no AMX
    got = attend(SPANS + LONG_SPANS, 16, heads, kv_heads, dim, dtype, True, monkeypatch, seed=heads)
    want = attend(SPANS + LONG_SPANS, 16, heads, kv_heads, dim, dtype, False, monkeypatch, seed=heads)
    atol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("rows,n,k", [(1, 64, 576), (7, 64, 100), (16, 960, 576)])
def test_the_avx2_gemm_matches_torch_too(rows, n, k, avx2_build, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: avx2_build)
    monkeypatch.setattr(cpu_kernels, "panel_columns", lambda: avx2_build.gemm_panel_columns())
    w, x = torch.randn(n, k), torch.randn(rows, k)
    torch.testing.assert_close(cpu_kernels.gemm(x, cpu_kernels.pack(w)), x @ w.T, atol=1e-4 * k ** 0.5, rtol=1e-5)


def test_shapes_it_does_not_take_go_to_torch():
    q = torch.zeros(2, 8, 64)
    assert not cpu_kernels.attention_usable(q.half(), torch.zeros(1, 16, 2, 64).half())  # fp16: the torch path
    assert not cpu_kernels.attention_usable(q, torch.zeros(1, 16, 2, 64).bfloat16())  # mixed dtypes
    assert not cpu_kernels.attention_usable(torch.zeros(2, 8, 512), torch.zeros(1, 16, 2, 512))  # head dim over 256
    strided = torch.zeros(2, 8, 64)[..., ::2]
    assert not cpu_kernels.attention_usable(strided, torch.zeros(1, 16, 2, 32))


def test_where_there_is_a_compiler_the_kernels_build():
    assert cpu_kernels.load() is not None, "the kernels failed to build: see the warning logged above"


def test_without_a_compiler_the_engine_keeps_the_torch_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLOFLEET_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="slofleet.engine.kernel"):
            assert cpu_kernels.load() is None
        assert "using torch ops" in caplog.text
        assert not cpu_kernels.attention_usable(torch.zeros(1, 9, 64), torch.zeros(1, 16, 3, 64))
        assert not list(tmp_path.rglob("*.so"))
    finally:
        cpu_kernels.load.cache_clear()


def cpu_ops(dtype: torch.dtype) -> CpuOps:
    return CpuOps(16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("delta_layout", [None, "rows", "columns"])
def test_add_rms_norm_matches_torch(dtype, rows, delta_layout, monkeypatch):
    """The residual add and RMSNorm in one pass: x updated in place and the normalised rows as torch computes them,
    with the delta as a W @ x.T product hands it over (column-major) or row-major."""
    check_norm(dtype, rows, delta_layout, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 100])  # 100: a tail past the vectors and the sixteen running sums
def test_the_avx2_norm_matches_torch_too(dtype, hidden, avx2_build, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: avx2_build)
    check_norm(dtype, 300, "rows", monkeypatch, hidden)


def check_norm(dtype, rows, delta_layout, monkeypatch, hidden=576):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn((rows, hidden), generator=gen) * 3).to(dtype)
    delta = {None: None, "rows": torch.randn((rows, hidden), generator=gen).to(dtype),
             "columns": torch.randn((hidden, rows), generator=gen).to(dtype).T}[delta_layout]
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
        x2 = x.clone()
        got = cpu_ops(dtype).add_rms_norm(x, delta, norm.weight, norm.eps)
        want = TorchOps(16).add_rms_norm(x2, delta, norm.weight, norm.eps)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding apart where a sum's order differs
    torch.testing.assert_close(x, x2, atol=0, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_rope_matches_torch(dtype, rows, monkeypatch):
    """q and k heads rotated in place inside the fused qkv rows, V untouched, as the torch ops rotate them."""
    config = SimpleNamespace(rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    rotary = Rotary(config, 64, 4096)
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn((rows, 15 * 64), generator=gen).to(dtype)
    cos, sin = rotary.at(torch.randint(0, 4096, (rows,), generator=gen))
    want = TorchOps(16).rotate(qkv[:, :12 * 64].unflatten(1, (12, 64)), cos, sin)
    v = qkv[:, 12 * 64:].clone()
    got = cpu_ops(dtype).rotate(qkv[:, :12 * 64].unflatten(1, (12, 64)), cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place, no copy
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(qkv[:, 12 * 64:], v, atol=0, rtol=0)


@pytest.mark.parametrize("rows,inter", [(8, 1536), (300, 1536), (9, 1541)])  # a row tail past 16 lanes too
def test_silu_mul_rounds_as_torch_in_bf16(rows, inter, monkeypatch):
    """The fused SiLU-and-mul (AVX-512 CPUs): bf16 results bit for bit those of silu(gate).mul_(up)."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn((rows, 2 * inter), generator=gen) * 4).to(torch.bfloat16)
    if not cpu_kernels.silu_usable(gate_up):
        pytest.skip("no AVX-512 on this CPU: the kernel is not built and torch's ops run")
    got = cpu_ops(torch.bfloat16).silu_mul(gate_up)
    want = TorchOps(16).silu_mul(gate_up)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("rows,inter", [(8, 1536), (300, 1536), (9, 1541)])  # 1541: a row tail past the vectors
def test_the_fp32_silu_kernel_is_torchs_silu_bit_for_bit(rows, inter):
    """fp32 SiLU-and-mul calls torch's own vector exp (cpu_kernels.TORCH_EXP), so its results are torch's; found and
    taken wherever torch's CPU kernels run AVX2 (checked here) or AVX-512 (taken only where a probe agrees)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in cpu_kernels.TORCH_EXP:
        pytest.skip(f"torch runs {capability} kernels here, with no vector exp the kernel takes")
    if capability == "AVX512" and not cpu_kernels.has_silu_fp32():
        pytest.skip("torch's AVX-512 SiLU is not g / (1 + Sleef's exp(-g)) in this torch: its ops run")
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn((rows, 2 * inter), generator=gen) * 6
    assert cpu_kernels.silu_usable(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu_ops(torch.float32).silu_mul(gate_up)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate).mul_(up), atol=0, rtol=0)
    assert not cpu_kernels.silu_usable(gate_up[:7]), "a decode's few rows take torch's two ops, the same bits"


def gemm_cases():
    """(rows, N, K): a lone decode, rows around the 8-row tile, a prefill chunk, prompts of several chunks of rows
    (1 MiB of x each: 455 rows at K = 576, 170 at 1536; the last chunk short); K off the vector width too."""
    return [(1, 64, 576), (5, 96, 100), (6, 32, 7), (7, 64, 576), (8, 64, 576), (9, 32, 100), (16, 960, 576),
            (33, 128, 1536), (300, 64, 48), (1000, 64, 576), (900, 32, 1536)]


@pytest.mark.parametrize("rows,n,k", gemm_cases())
def test_the_fp32_gemm_kernel_matches_torch(rows, n, k):
    if not cpu_kernels.panel_columns():
        pytest.skip("no AVX2 or AVX-512 here: the GEMM kernel is not built and torch's runs")
    gen = torch.Generator().manual_seed(rows * n + k)
    w, x = torch.randn((n, k), generator=gen), torch.randn((rows, 2 * k), generator=gen)[:, ::2]  # strided rows
    got = cpu_kernels.gemm(x, cpu_kernels.pack(w))
    assert got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, x @ w.T, atol=1e-4 * k ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("n", [96, 960])  # on AVX2 6 panels (at one row a tile of 4 side by side, then 2), and 60
def test_a_rows_fp32_product_is_the_same_bits_in_any_batch(n):
    """small_gemm's sums run in one order whatever a step's rows (one or two rows' wide tiles, a tile's, a chunk's),
    so a sequence's logits do not depend on what it is batched with: speculative verification relies on it."""
    if not cpu_kernels.panel_columns():
        pytest.skip("no AVX2 or AVX-512 here: the GEMM kernel is not built and torch's runs")
    gen = torch.Generator().manual_seed(n)
    w, x = torch.randn((n, 576), generator=gen), torch.randn((40, 576), generator=gen)
    packed = cpu_kernels.pack(w)
    whole = cpu_kernels.gemm(x, packed)
    for size in (1, 2, 3, 16):
        parts = torch.cat([cpu_kernels.gemm(x[i:i + size], packed) for i in range(0, len(x), size)])
        assert torch.equal(parts, whole), f"rows {size} at a time"


def test_only_what_the_gemm_kernel_takes_is_packed():
    c = cpu_kernels.panel_columns()
    if not c:
        pytest.skip("no GEMM kernel on this CPU")
    assert cpu_kernels.pack(torch.zeros(c + 1, 8)) is None  # N off the panel width: torch's GEMM
    assert cpu_kernels.pack(torch.zeros(c, 8, dtype=torch.bfloat16)) is None
    assert cpu_kernels.pack(torch.zeros(2 * c, 8)).shape == (2, 8, c)


def tile_cases():
    """(rows, N, K): a lone decode, a decode step, the tiles' one and two 16-row blocks and a tail, the vector
    kernel's items of up to 12 rows (a chunk's rows split evenly) and its 24-row chunks, a prefill chunk past the
    tiles' chunk of work items (256 rows); N and K at the model's sizes and at the kernels' smallest (32)."""
    return [(1, 960, 576), (5, 32, 32), (16, 1536, 576), (17, 576, 1536), (32, 64, 96), (33, 96, 64),
            (300, 128, 576), (16, 49152, 576)]


@pytest.fixture(params=["tile_gemm", "dot_gemm"])
def bf16_kernel(request, monkeypatch):
    """Each bf16 GEMM kernel this CPU runs (AMX tiles, AVX512-BF16 dot products), as the one pack and gemm use."""
    if request.param not in cpu_kernels.bf16_kernels():
        pytest.skip(f"{request.param} does not run on this CPU: torch's bf16 GEMM or the other kernel does")
    monkeypatch.setattr(cpu_kernels, "bf16_gemm", lambda: request.param)
    return request.param


@pytest.mark.parametrize("rows,n,k", tile_cases())
def test_the_bf16_kernels_match_torch(rows, n, k, bf16_kernel):
    gen = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn((n, k), generator=gen).bfloat16()
    x = torch.randn((rows, 2 * k), generator=gen).bfloat16()[:, ::2]  # strided rows
    packed = cpu_kernels.pack(w)
    assert packed.shape == (n // 16, k // 2, 16, 2)
    got = cpu_kernels.gemm(x, packed)
    assert got.shape == (rows, n) and got.is_contiguous() and got.dtype == torch.bfloat16
    # fp32 sums of bf16 products, rounded once: as far from the exact product as torch's own bf16 result is
    exact = x.float() @ w.float().T
    assert (got.float() - exact).abs().max() <= 2 * (torch.mm(x, w.T).float() - exact).abs().max() + 1e-3


@pytest.mark.parametrize("rows", [1, 16, 40, 300])
def test_the_swiglu_epilogue_equals_the_product_then_silu_mul(rows, bf16_kernel):
    """Paired gate/up tiles end in silu(gate) * up: the same bits as the whole product then the SiLU kernel."""
    gen = torch.Generator().manual_seed(rows)
    inter, k = 96, 64
    w = torch.randn((2 * inter, k), generator=gen).bfloat16()
    x = torch.randn((rows, k), generator=gen).bfloat16()
    fused = cpu_kernels.gemm(x, cpu_kernels.pack(w, paired=True), silu=True)
    product = cpu_kernels.gemm(x, cpu_kernels.pack(w))
    gate, up = product.chunk(2, dim=-1)
    assert fused.shape == (rows, inter)
    assert torch.equal(fused, torch.nn.functional.silu(gate).mul_(up))
    with pytest.raises(ValueError):  # the fp32 kernel has no such epilogue
        cpu_kernels.gemm(torch.zeros(2, 64), cpu_kernels.pack(torch.zeros(64, 64)), silu=True)


@pytest.mark.parametrize("paired", [False, True])
def test_a_rows_bf16_product_is_the_same_bits_in_any_batch(paired, bf16_kernel):
    """Each bf16 kernel's sums run over K in one order whatever a step's rows (an item's, a chunk's, a tile's), so a
    sequence's logits do not depend on what it is batched with (test_forms: a form gives the same bits as the tiles)."""
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn((192, 576), generator=gen).bfloat16(), torch.randn((40, 576), generator=gen).bfloat16()
    packed = cpu_kernels.pack(w, paired)
    whole = cpu_kernels.gemm(x, packed, silu=paired)
    for size in (1, 2, 13, 16):
        parts = torch.cat([cpu_kernels.gemm(x[i:i + size], packed, silu=paired) for i in range(0, len(x), size)])
        assert torch.equal(parts.view(torch.int16), whole.view(torch.int16)), f"rows {size} at a time"


def test_only_what_the_bf16_kernels_take_is_packed(bf16_kernel):
    bf16 = dict(dtype=torch.bfloat16)
    assert cpu_kernels.pack(torch.zeros(48, 64, **bf16)) is None  # N off the 32-column pair of tiles
    assert cpu_kernels.pack(torch.zeros(64, 48, **bf16)) is None  # K off the 32-element step
    assert cpu_kernels.pack(torch.zeros(64, 64, dtype=torch.float16)) is None
    with pytest.raises(ValueError):  # x in another dtype than the weight it meets
        cpu_kernels.gemm(torch.zeros(2, 64), cpu_kernels.pack(torch.zeros(64, 64, **bf16)))


def test_a_bf16_layer_with_tiles_answers_as_its_weight_did(bf16_kernel):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=True).bfloat16()
    x = torch.randn(9, 64).bfloat16()
    want = torch.nn.functional.linear(x, layer.weight, layer.bias).float()
    layer.panels = cpu_kernels.pack(layer.weight)
    torch.testing.assert_close(cpu_ops(torch.bfloat16).linear(x, layer).float(), want, atol=0.05, rtol=0.02)


def test_a_layer_with_panels_answers_as_its_weight_did():
    """CpuOps.linear takes a layer's panels (CpuOps.prepare's), bias included, as F.linear took its weight."""
    if not cpu_kernels.panel_columns():
        pytest.skip("no GEMM kernel on this CPU")
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 8 * cpu_kernels.panel_columns(), bias=True)
    x = torch.randn(9, 48)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.panels = cpu_kernels.pack(layer.weight)
    torch.testing.assert_close(cpu_ops(torch.float32).linear(x, layer), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 700])  # a decode step, and a prefill chunk the threads share
def test_the_kv_store_puts_rows_where_index_copy_does(dtype, rows):
    """K and V as model.py hands them (views of the fused qkv rows) into their slots, as the torch path writes them;
    the other slots keep what they held."""
    blocks, bs, kvh, d = 64, 16, 3, 64
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn((rows, (9 + 2 * kvh) * d), generator=gen).to(dtype)
    k, v = qkv[:, 9 * d:(9 + kvh) * d].view(rows, kvh, d), qkv[:, (9 + kvh) * d:].view(rows, kvh, d)
    slots = torch.randperm(blocks * bs, generator=gen)[:rows]
    held = torch.randn((2, blocks, bs, kvh, d), generator=gen).to(dtype)
    caches = [held.clone(), held.clone()]
    assert cpu_kernels.kv_store_usable(k, v, caches[0][0], slots)
    cpu_kernels.kv_store(k, v, caches[0][0], caches[0][1], slots)
    TorchAttention.write(k, v, caches[1][0], caches[1][1], slots)
    assert torch.equal(caches[0], caches[1]) and not torch.equal(caches[0], held)
    assert not cpu_kernels.kv_store_usable(k, v, caches[0][0], slots.int())  # int32 slots: index_copy_ takes them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 7, 16, 33, 1000, 49152])
def test_argmax_finds_each_rows_first_maximum_as_torch_does(dtype, width):
    """Ties go to the first index (in the vector part, across lanes, and in the tail), an all -inf row to 0, and a row
    holding a NaN hands the batch back to torch."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn((6, width), generator=gen).to(dtype)
    x[1, -1] = x[1, width // 2] = 50.0  # a tie: the earlier wins
    x[2] = float("-inf")
    x[3, :] = 7.0  # every value the maximum
    x[4, 0] = 60.0
    got = cpu_kernels.argmax(x)
    assert got is not None and torch.equal(got, x.float().max(-1).indices)
    x[5, width - 1] = float("nan")
    assert cpu_kernels.argmax(x) is None
    assert cpu_kernels.argmax(x[:, :1].expand(6, 3)) is None  # strided rows: not the kernel's
