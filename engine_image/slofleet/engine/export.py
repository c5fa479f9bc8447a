"""`slofleet export-hf DIR`: write a model as a self-contained Hugging Face directory that other runtimes load.

vLLM reads Hugging Face directories, not the GGUF that slofleet embeds; an LLMService whose runtime is vLLM runs
this as an init step into a shared volume. The weights are slofleet's own dequantisation (loader.convert_gguf),
so both runtimes serve the same numbers; they are cast to the requested dtype on the way out.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from . import loader
from .config import DEFAULT_MODEL

DTYPES = ("float32", "bfloat16", "float16")
# Files a loader needs besides the weights; anything else in the source directory stays behind.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


class ExportError(ValueError):
    """A request the export cannot honour (bad destination, unknown dtype); the CLI prints it as one line."""


def _check_dest(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} is not empty (pass --force to replace it)")


def _write_weights(src: Path, dest: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    target = getattr(torch, dtype)
    tensors = loader.read_tensors(src)
    save_file({k: v.to(target).contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})


def _write_config(dest: Path, dtype: str) -> None:
    path = dest / "config.json"
    config = json.loads(path.read_text())
    # Both keys: transformers 5 reads `dtype`, older readers (and vLLM's --dtype auto) `torch_dtype`.
    config["dtype"] = config["torch_dtype"] = dtype
    path.write_text(json.dumps(config, indent=2) + "\n")
    gen = dest / "generation_config.json"
    if not gen.exists():
        keys = ("bos_token_id", "eos_token_id", "pad_token_id")
        gen.write_text(json.dumps({k: config[k] for k in keys if k in config}, indent=2) + "\n")


def _inline_chat_template(dest: Path) -> None:
    """Copy chat_template.jinja into tokenizer_config.json too: tokenizers saved before the .jinja file existed,
    and some runtimes, only look there."""
    jinja, tok = dest / "chat_template.jinja", dest / "tokenizer_config.json"
    if jinja.exists() and tok.exists():
        config = json.loads(tok.read_text())
        config.setdefault("chat_template", jinja.read_text())
        tok.write_text(json.dumps(config, indent=2) + "\n")


def export_hf(model: str, out: Path, *, dtype: str = "float32", force: bool = False) -> Path:
    """Write `model` ('default', a GGUF file or a Hugging Face directory) into `out`; returns `out`."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = out.expanduser().resolve()
    _check_dest(out, force)
    try:
        src = loader.resolve(model)
    except FileNotFoundError as e:
        raise ExportError(str(e)) from e
    if src.resolve() == out:
        raise ExportError(f"{out} is the model's own directory")
    tmp = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in SIDE_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, tmp / name)
    _write_weights(src, tmp, dtype)
    _write_config(tmp, dtype)
    _inline_chat_template(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="directory to write (created; must be empty unless --force)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="'default' (embedded SmolLM2-135M-Instruct), a GGUF file or a Hugging Face directory")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the written weights")
    parser.add_argument("--force", action="store_true", help="replace a non-empty DIR")


def run(args: argparse.Namespace) -> int:
    try:
        out = export_hf(args.model, args.dir, dtype=args.dtype, force=args.force)
    except ExportError as e:
        print(f"slofleet export-hf: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
