"""The layer stack (layer_stack.py, layer_stack.cpp): a step's decoder layers in one call into the CPU kernels give
the layers' own loop's tokens and logprobs bit for bit, in bf16 and in fp32, on decode steps, on steps that mix
decodes with prompt chunks over a cached context, and with drafted tokens; bf16 steps it does not take (more rows than
cpu_kernels.DIRECT_ROWS) run the loop, while fp32 takes steps of any size."""
from __future__ import annotations

import pytest

from slofleet.engine import LLM, SamplingParams
from slofleet.engine.backends.cpu import cpu_kernels
from slofleet.engine.backends.cpu.layer_stack import GEMMS, LayerStack
from slofleet.engine.backends.cpu.ops import CpuOps

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels did not build here")

PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):",
           "Once upon a time " * 60, "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4,"]


@pytest.fixture(params=["bfloat16", "float32"])
def dtype(request) -> str:
    """The weights' dtype, where this CPU has the stack's kernels for it."""
    if request.param == "bfloat16" and cpu_kernels.bf16_gemm() not in GEMMS:
        pytest.skip("no bf16 GEMM kernel (AMX or AVX512-BF16) on this CPU")
    if request.param == "float32" and not (cpu_kernels.panel_columns() and cpu_kernels.has_silu_fp32()):
        pytest.skip("no fp32 GEMM kernel or no SiLU kernel with torch's exp on this CPU")
    return request.param


def generate(stacked: bool, monkeypatch, dtype: str, **config) -> tuple[list, list[tuple[int, ...]], LLM]:
    """Outputs, and the query lengths of every step the stack ran, with the stack on or off."""
    llm = LLM(dtype=dtype, max_num_seqs=8, **config)
    model = llm.engine.runner.model
    steps: list[tuple[int, ...]] = []
    if stacked:
        assert isinstance(model.stack, LayerStack)
        run = LayerStack.run

        def recorded(self, x, cos, sin, kv_caches, meta):
            out = run(self, x, cos, sin, kv_caches, meta)
            if out is not None:
                steps.append(tuple(meta.query_lens_host))
            return out

        monkeypatch.setattr(LayerStack, "run", recorded)
    else:
        model.stack = None
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    return [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, params)], steps, llm


@pytest.mark.parametrize("forms", [True, False], ids=["gguf forms", "plain weights"])
def test_stacked_steps_give_the_loops_tokens_and_logprobs(forms, dtype, monkeypatch):
    if not forms:
        monkeypatch.setattr(CpuOps, "forms", lambda self, model, dtype: {})
    # 48 tokens a step: the long prompt's chunks run beside the others' decodes, over the context cached before them
    with_stack, steps, llm = generate(True, monkeypatch, dtype, max_num_batched_tokens=48)
    model = llm.engine.runner.model
    in_forms = bool(cpu_kernels.form_of(model.layers[0].qkv_proj.panels))
    assert in_forms == (forms and cpu_kernels.unpacks(model.stack.dtype))
    without, _, _ = generate(False, monkeypatch, dtype, max_num_batched_tokens=48)
    assert with_stack == without
    assert any(max(q) == 1 for q in steps), "no decode-only step ran stacked"
    assert any(1 in q and max(q) > 1 for q in steps), "no step mixing decodes with a prompt chunk ran stacked"


def test_drafted_tokens_verify_in_stacked_steps(dtype, monkeypatch):
    spec = {"num_speculative_tokens": 3, "speculative_ngram": 2}
    with_stack, steps, _ = generate(True, monkeypatch, dtype, **spec)
    without, _, _ = generate(False, monkeypatch, dtype, **spec)
    assert with_stack == without
    assert any(1 < max(q) <= 4 and len(q) > 1 for q in steps), "no step with drafts ran stacked"


def test_a_bf16_step_of_more_rows_than_the_kernels_unpack_runs_the_loop_and_an_fp32_one_stacks(dtype, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "DIRECT_ROWS", 128)  # below these prompts' rows, so one step needs no long prompt
    _, steps, llm = generate(True, monkeypatch, dtype, max_num_batched_tokens=2048)
    prompt_rows = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert prompt_rows > cpu_kernels.DIRECT_ROWS and steps  # the first step prefills them all, then decodes stack
    longest = max(sum(q) for q in steps)
    assert longest <= cpu_kernels.DIRECT_ROWS if dtype == "bfloat16" else longest == prompt_rows
