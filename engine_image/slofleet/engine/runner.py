"""Build the flat batch for one step, own the KV cache tensors, and run the model."""
from __future__ import annotations

import ctypes
import functools
import logging
import platform
from pathlib import Path

import torch

from . import backends
from .backends.cpu import cpu_kernels, dtype_probe
from .backends.ops import AttentionMetadata, Ops
from .backends.triton import cuda_graphs  # imports triton only where it captures
from .config import EngineConfig
from .loader import load_config, read_tensors
from .model import CausalLM
from .request import Request

log = logging.getLogger("slofleet.engine.runner")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# glibc's mallopt parameters: allocations from this size on are mmapped, and free memory above this at the top of the
# heap goes back to the kernel.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BYTES = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Keep freed memory in the process's heap (glibc): by default a step's activations of some MBs are mmapped, given
    back when freed and faulted in again, zeroed, by the next step, thousands of page faults a run
    (docs/kernels-notes.md). The heap then stays at the engine's peak use, as with tcmalloc, which vLLM's CPU backend
    preloads for the same reason. Process-wide: once."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))


class ModelRunner:
    def __init__(self, config: EngineConfig, path: Path, max_len: int):
        self.device = pick_device(config.device)
        self.block_size = config.block_size
        self.hf_config = load_config(path)
        self.dtype_choice = dtype_probe.choose(config.dtype, self.device, self.hf_config.hidden_size,
                                               self.hf_config.intermediate_size)
        self.dtype = dtype_probe.DTYPES[self.dtype_choice.dtype]
        if self.device.type == "cpu":
            cpu_kernels.load()  # built (seconds, once per machine) at start rather than in the first decode
            keep_freed_memory()
        self.ops: Ops = backends.pick(self.device, self.dtype, config.block_size)  # once: the model never asks again
        self.attention = self.ops.attention
        self.max_len, self.max_num_seqs, self.graphs = max_len, config.max_num_seqs, None
        self.use_cuda_graphs = config.cuda_graphs
        with torch.device("meta"):
            model = CausalLM(self.hf_config, self.ops, max_len)
        model = model.to_empty(device=self.device)
        model.rotary.to(self.device)
        if getattr(self.hf_config, "tie_word_embeddings", False):
            model.lm_head.weight = model.embed_tokens.weight
        model.load_hf_state_dict(read_tensors(path))
        # where a GEMM kernel of the model's dtype unpacks them, it reads a GGUF checkpoint's weights in their
        # quantised forms (backends/cpu/quant.py): seen before the cast, which loses what tells them apart
        forms = self.ops.forms(model, self.dtype)
        self.model = model.to(self.dtype).eval()
        self.ops.prepare(model, forms)
        if forms:
            log.info("%d of the model's projections kept in their GGUF forms", len(forms))
        layer = model.layers[0]
        self.kv_shape = (config.block_size, layer.n_kv, layer.head_dim)
        self.num_layers = len(model.layers)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def bytes_per_block(self) -> int:
        elems = self.kv_shape[0] * self.kv_shape[1] * self.kv_shape[2]
        return 2 * self.num_layers * elems * torch.tensor([], dtype=self.dtype).element_size()

    def allocate_kv(self, num_blocks: int) -> None:
        self.kv_caches = [
            (torch.zeros((num_blocks, *self.kv_shape), dtype=self.dtype, device=self.device),
             torch.zeros((num_blocks, *self.kv_shape), dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)]
        # Graphs hold the cache tensors, so they are captured again after any re-allocation.
        if self.use_cuda_graphs:
            self.graphs = cuda_graphs.maybe_capture(self.model, self.kv_caches, self.attention, self.max_num_seqs,
                                                    -(-self.max_len // self.block_size), self.max_len, self.device)

    def read_kv(self, table: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the K and V blocks in `table`, [layers, blocks, block_size, kv_heads, head_dim], on the CPU."""
        idx = torch.tensor(table, dtype=torch.long, device=self.device)
        return (torch.stack([k[idx] for k, _ in self.kv_caches]).cpu(),
                torch.stack([v[idx] for _, v in self.kv_caches]).cpu())

    def write_kv(self, table: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        idx = torch.tensor(table, dtype=torch.long, device=self.device)
        for layer, (kc, vc) in enumerate(self.kv_caches):
            kc[idx] = k[layer].to(device=self.device, dtype=kc.dtype)
            vc[idx] = v[layer].to(device=self.device, dtype=vc.dtype)

    def prepare(self, batch: list[tuple[Request, int, list[int]]]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten (request, tokens this step, block table) into model inputs, attention metadata and the rows to
        sample: the last token of each request, and each of a draft's tokens before it (speculative.py). Everything
        travels in two tensors (int64: ids, positions, slots, rows; int32: query starts, lengths, block tables)
        that the fields are views of: two small host tensors and two copies to the device per step."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        qsl, slens, qlens = [0], [], []
        for req, n, table in batch:
            start = req.num_computed_tokens
            if n == 1:
                ids.append(req.token_at(start))
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids += [req.token_at(start), *req.draft] if req.draft else req.token_ids()[start:start + n]
                pos = range(start, start + n)
                positions += pos
                slots += [table[p // bs] * bs + p % bs for p in pos]
            qsl.append(qsl[-1] + n)
            rows += range(qsl[-1] - 1 - len(req.draft), qsl[-1])
            qlens.append(n)
            slens.append(start + n)
        width = max(len(t) for _, _, t in batch)
        tables: list[int] = []
        for _, _, t in batch:
            tables += t
            tables += [0] * (width - len(t))
        nt, b = len(ids), len(batch)
        longs = torch.tensor(ids + positions + slots + rows, dtype=torch.long, device=self.device)
        ints = torch.tensor(qsl + slens + tables, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=longs[2 * nt:3 * nt], query_start_loc=ints[:b + 1], seq_lens=ints[b + 1:2 * b + 1],
            block_tables=ints[2 * b + 1:].view(b, width),
            max_query_len=max(qlens), max_seq_len=max(slens), query_lens_host=qlens, seq_lens_host=slens)
        return longs[:nt], longs[nt:2 * nt], meta, longs[3 * nt:]

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Request, int, list[int]]]) -> torch.Tensor:
        """Logits at the last new token of every request in the batch, each preceded by its draft's rows
        ([B + drafted tokens, vocab], in the model's dtype)."""
        input_ids, positions, meta, rows = self.prepare(batch)
        if self.graphs is not None and self.graphs.can_run(meta):
            return self.graphs.run(input_ids, positions, meta)  # valid until the next replay; sampled at once
        return self.model(input_ids, positions, self.kv_caches, meta, rows)
