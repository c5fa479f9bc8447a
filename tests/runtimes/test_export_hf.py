"""`slofleet export-hf`: the written directory is a standalone Hugging Face model equal to slofleet's engine."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slofleet.engine.export import ExportError, export_hf


def test_refuses_a_non_empty_directory_without_force(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="not empty"):
        export_hf("default", tmp_path)
    assert (tmp_path / "keep.txt").exists()


def test_refuses_an_unknown_dtype_and_a_missing_model(tmp_path):
    with pytest.raises(ExportError, match="dtype must be one of"):
        export_hf("default", tmp_path / "a", dtype="int3")
    with pytest.raises(ExportError, match="expected 'default'"):
        export_hf(str(tmp_path / "nope.gguf"), tmp_path / "b")


def test_cli_error_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "x").write_text("x")
    r = subprocess.run([sys.executable, "-m", "slofleet.cli", "export-hf", str(tmp_path), "--model", "default"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "not empty" in r.stderr


@pytest.mark.slow
def test_exported_directory_matches_the_engine_greedy(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slofleet.engine import LLMEngine, SamplingParams

    out = export_hf("default", tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()

    engine = LLMEngine(dtype="float32")
    req = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(ref) == 16 and req.output_token_ids == ref


@pytest.mark.slow
def test_bfloat16_export_halves_the_weights(tmp_path):
    fp32 = export_hf("default", tmp_path / "f32")
    bf16 = export_hf("default", tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ratio = (bf16 / "model.safetensors").stat().st_size / (fp32 / "model.safetensors").stat().st_size
    assert 0.49 < ratio < 0.51
