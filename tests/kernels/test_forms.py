"""GGUF weights kept in their quantised forms (quant.py, forms.h): Q4_1 and Q8_0 found back exactly from what gguf
dequantises, or not at all; unpacked to the very bf16 tiles the packed weight holds; the GEMM on them bit for bit the
bf16 one (the tile kernel, AMX) or the fp32 one (form_gemm, AVX-512 or AVX2); and an engine on the embedded model (Q4_1
projections, a Q8_0 embedding as its LM head) giving the same tokens and logprobs with and without them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import GGMLQuantizationType, dequantize, quantize

from slofleet.engine.backends.cpu import cpu_kernels, quant
from slofleet.engine.backends.cpu.ops import CpuOps, gguf_forms
from slofleet.engine.model import CausalLM

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler here to build the kernels")


KINDS = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def gguf_weight(n: int, k: int, seed: int, kind: str = "q4_1") -> torch.Tensor:
    """An fp32 weight as loading a GGUF gives it: quantised and dequantised by gguf itself."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.05
    return torch.from_numpy(dequantize(quantize(w, KINDS[kind]), KINDS[kind]).copy())


@pytest.mark.parametrize("kind", KINDS)
def test_recover_gives_back_every_weight_bit_for_bit(kind):
    w = gguf_weight(96, 160, seed=1, kind=kind)
    form = quant.recover(w)
    assert form is not None and form.kind == kind
    assert form.q.shape == (96, 160) and form.d.shape == (96, 5) and form.d.dtype == torch.float16
    blocks = form.q.view(96, 5, 32).float()
    got = form.d.float()[..., None] * blocks
    if kind == "q4_1":
        assert form.q.dtype == torch.uint8 and int(form.q.max()) <= 15 and form.m.shape == (96, 5)
        got = got + form.m.float()[..., None]
    else:
        assert form.q.dtype == torch.int8 and form.m is None and int(form.q.abs().max()) == 127
    assert torch.equal(got.reshape(96, 160), w)


@pytest.mark.parametrize("kind", KINDS)
def test_a_constant_block_is_recovered_too(kind):
    w = gguf_weight(32, 64, seed=2, kind=kind)
    w[3, 32:] = w[3, 32] if kind == "q4_1" else 0.0  # Q4_1: every q 0, its d says nothing; Q8_0: d is 0
    form = quant.recover(w)
    assert form is not None and form.kind == kind and torch.equal(form.q[3, 32:], form.q[3, 32:].new_zeros(32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("row", [0, 100])  # in the rows tried first, and past them
def test_one_weight_off_its_grid_keeps_the_whole_weight_as_it_is(row, kind):
    w = gguf_weight(128, 64, seed=3, kind=kind)
    w[row, 5] = torch.nextafter(w[row, 5], torch.tensor(1.0))
    assert quant.recover(w) is None


@pytest.mark.parametrize("weight", [torch.randn(64, 64), torch.randn(64, 64).bfloat16().float(),
                                    torch.zeros(64, 48), torch.zeros(0, 64), torch.zeros(64, 64).bfloat16()],
                         ids=["fp32", "bf16 values", "K off the block", "no rows", "a bf16 tensor"])
def test_weights_of_another_origin_have_no_form(weight):
    assert quant.recover(weight) is None


def forms(n: int, k: int, seed: int, kind: str) -> tuple[torch.Tensor, quant.Form]:
    w = gguf_weight(n, k, seed, kind)
    return w.bfloat16(), quant.recover(w)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("paired", [False, True])
def test_the_form_unpacks_to_the_packed_bf16_tiles(paired, kind):
    if cpu_kernels.bf16_gemm() is None or cpu_kernels.load().form_unpack(None, 0, 0, 1, None, 1) != 0:
        pytest.skip("no bf16 kernel or form unpacking on this CPU")
    w, form = forms(128, 192, seed=4, kind=kind)
    layout = quant.layout(form, cpu_kernels.panel_rows(128, paired))
    assert layout.shape == (8, 6, quant.STEP_BYTES[kind]) and layout.dtype == torch.uint8
    tiles = torch.empty((8, 96, 16, 2), dtype=torch.bfloat16)
    cpu_kernels.load().tile_pack(w.contiguous().data_ptr(), 128, 192, int(paired), tiles.data_ptr())
    assert torch.equal(cpu_kernels.unpack(layout).view(torch.int16), tiles.view(torch.int16))


needs_bf16_forms = pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.unpacks(),
                                      reason="the bf16 kernels keep GGUF forms with AVX512-BF16; this CPU has none")


@needs_kernels
@needs_bf16_forms
@pytest.mark.parametrize("rows", [1, 16, 17, 33, 100, cpu_kernels.DIRECT_ROWS, cpu_kernels.DIRECT_ROWS + 1, 600])
@pytest.mark.parametrize("paired,kind,n,k", [(False, "q4_1", 192, 576), (True, "q4_1", 192, 576),
                                             (False, "q8_0", 192, 576), (True, "q4_1", 1344, 1536)])
def test_the_gemm_on_the_form_is_the_bf16_gemm_bit_for_bit(rows, paired, kind, n, k):
    """Up to DIRECT_ROWS rows, the kernel unpacks the form's panels itself: the tile kernel a pair of panels once per
    chunk of 512 rows (600: two chunks), the dot-product kernel a group of pairs for all the rows (at K = 1,536, at
    most 4 pairs a group: 1,344 columns' 42 pairs make several groups a thread, the last one short); more unpack the
    whole weight first: each gives the bf16 kernel's bits, the SwiGLU epilogue's included."""
    w, form = forms(n, k, seed=rows, kind=kind)
    packed = cpu_kernels.pack(w, paired, form)
    bits = {"q4_1": 5, "q8_0": 8.5}[kind]
    assert packed.dtype == torch.uint8 and packed.numel() * 8 == w.numel() * bits
    x = torch.randn((rows, 2 * k), generator=torch.Generator().manual_seed(rows)).bfloat16()[:, ::2]
    got = cpu_kernels.gemm(x, packed, silu=paired)
    want = cpu_kernels.gemm(x, cpu_kernels.pack(w, paired), silu=paired)
    assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError):  # fp32 rows do not meet bf16 weights
        cpu_kernels.gemm(x.float(), packed)


def test_the_embedded_models_projections_all_have_their_form(model_dir):
    from slofleet.engine.loader import load_config, read_tensors
    model = CausalLM(load_config(model_dir), CpuOps(16, torch.float32), 64)
    model.load_hf_state_dict(read_tensors(model_dir))
    found = gguf_forms(model)
    per_layer = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    layers = {id(getattr(layer, name)) for layer in model.layers for name in per_layer}
    assert found.keys() == layers | {id(model.lm_head)}
    assert {found[i].kind for i in layers} == {"q4_1"} and found[id(model.lm_head)].kind == "q8_0"  # the embedding


@pytest.fixture(scope="module")
def model_dir():
    from slofleet.engine import loader
    return loader.resolve("default")


needs_fp32_forms = pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.unpacks(torch.float32),
                                      reason="the fp32 kernel keeps GGUF forms on AVX-512 or AVX2; this CPU has none")


def form_gemm_is_small_gemm(rows: int, kind: str, k: int) -> None:
    """form_gemm unpacks each panel to the fp32 weights themselves, so its products are small_gemm's, bit for bit
    (where it goes by blocks of K, each tile's sums go to y and back between them: the same order of additions)."""
    w = gguf_weight(96, k, seed=rows, kind=kind)
    packed = cpu_kernels.pack(w, False, quant.recover(w))
    bits = {"q4_1": 5, "q8_0": 8.5}[kind]
    assert packed.dtype == torch.uint8 and packed.dim() == 4 and packed.numel() * 8 == w.numel() * bits
    x = torch.randn((rows, 2 * k), generator=torch.Generator().manual_seed(rows))[:, ::2]  # strided rows
    got = cpu_kernels.gemm(x, packed)
    assert torch.equal(got, cpu_kernels.gemm(x, cpu_kernels.pack(w)))
    for bad in ({"x": x.bfloat16()}, {"x": x, "silu": True}):  # bf16 rows; an epilogue only bf16 tiles have
        with pytest.raises(ValueError):
            cpu_kernels.gemm(bad["x"], packed, silu=bad.get("silu", False))


@needs_kernels
@needs_fp32_forms
# up to 64 rows, blocks of 128 k-rows (K = 576: the last 64); 1,000 at K = 1,536: six chunks of rows, each unpacking
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 64, 65, 100, 1000])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [576, 1536])
def test_the_fp32_gemm_on_the_form_is_the_fp32_gemm_bit_for_bit(rows, kind, k):
    form_gemm_is_small_gemm(rows, kind, k)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 17, 65])
@pytest.mark.parametrize("kind", KINDS)
def test_the_avx2_fp32_gemm_on_the_form_is_bit_for_bit_too(rows, kind, avx2_build, monkeypatch):
    """On an AVX-512 CPU, the AVX2 build's form_gemm (16-column panels, each one forms.h step a k-step)."""
    monkeypatch.setattr(cpu_kernels, "load", lambda: avx2_build)
    monkeypatch.setattr(cpu_kernels, "panel_columns", lambda: avx2_build.gemm_panel_columns())
    monkeypatch.setattr(cpu_kernels, "unpacks", lambda dtype=torch.bfloat16: dtype == torch.float32)
    assert avx2_build.form_gemm(None, 0, None, None, 0, 0, 0, 1, 1) == 0  # the AVX2 build unpacks forms
    form_gemm_is_small_gemm(rows, kind, 576)


@needs_kernels
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16_forms),
                                   pytest.param(torch.float32, marks=needs_fp32_forms)], ids=["bf16", "fp32"])
def test_an_engine_gives_the_same_tokens_and_logprobs_with_the_forms(dtype, monkeypatch):
    from slofleet.engine import LLM, SamplingParams
    prompts = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)

    def run():
        llm = LLM(dtype=str(dtype).removeprefix("torch."), max_num_seqs=4)
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)], llm.engine.runner.model

    with_forms, model = run()
    assert model.layers[0].gate_up_proj.panels.dtype == model.lm_head.panels.dtype == torch.uint8
    monkeypatch.setattr(CpuOps, "forms", lambda self, model, dtype: {})
    without, model = run()
    assert model.layers[0].gate_up_proj.panels.dtype == model.lm_head.panels.dtype == dtype
    assert with_forms == without
