"""Build the flat batch for one step, own the KV cache tensors, and run the model."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from . import cuda_graphs, dtype_probe
from .attention import AttentionBackend, AttentionMetadata, TorchAttention
from .config import EngineConfig
from .loader import load_config, read_tensors
from .model import CausalLM
from .request import Request

log = logging.getLogger("slofleet.engine.runner")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, path: Path, max_len: int):
        self.device = pick_device(config.device)
        self.block_size = config.block_size
        self.hf_config = load_config(path)
        self.dtype_choice = dtype_probe.choose(config.dtype, self.device, self.hf_config.hidden_size,
                                               self.hf_config.intermediate_size)
        self.dtype = dtype_probe.DTYPES[self.dtype_choice.dtype]
        self.attention: AttentionBackend
        if self.device.type == "cuda":
            from .triton_attention import TritonAttention  # lazy: the CPU path never imports triton
            self.attention = TritonAttention(config.block_size)
        else:
            self.attention = TorchAttention(config.block_size)
        self.max_len, self.max_num_seqs, self.graphs = max_len, config.max_num_seqs, None
        self.use_cuda_graphs = config.cuda_graphs
        with torch.device("meta"):
            model = CausalLM(self.hf_config, self.attention, max_len)
        model = model.to_empty(device=self.device)
        model.rotary.to(self.device)
        if getattr(self.hf_config, "tie_word_embeddings", False):
            model.lm_head.weight = model.embed_tokens.weight
        model.load_hf_state_dict(read_tensors(path))
        self.model = model.to(self.dtype).eval()
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
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten (request, tokens this step, block table) into model inputs and attention metadata."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        slens: list[int] = []
        sample_rows: list[int] = []
        for req, n, table in batch:
            start = req.num_computed_tokens
            toks = req.token_ids()[start:start + n] if n > 1 else [req.token_at(start)]
            ids += toks
            pos = range(start, start + n)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            qlens.append(n)
            slens.append(start + n)
            sample_rows.append(len(ids) - 1)
        max_blocks = max(len(t) for _, _, t in batch)
        tables = [t + [0] * (max_blocks - len(t)) for _, _, t in batch]
        dev = self.device
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(qlens), max_seq_len=max(slens), query_lens_host=qlens, seq_lens_host=slens)
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta, sample_rows)

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Request, int, list[int]]]) -> torch.Tensor:
        """Logits at the last new token of every request in the batch ([B, vocab], fp32)."""
        input_ids, positions, meta, rows = self.prepare(batch)
        if self.graphs is not None and self.graphs.can_run(meta):
            return self.graphs.run(input_ids, positions, meta)  # valid until the next replay; sampled at once
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model(input_ids, positions, self.kv_caches, meta, idx)
