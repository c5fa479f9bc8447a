"""CUDA graphs for decode steps: one graph per batch size, replayed with the batch padded up to it.

A decode step of a small model is mostly kernel-launch and Python overhead (hundreds of launches for a few
hundred microseconds of work), so each decode batch size in `sizes` is captured once and replayed. A batch
of n sequences runs in the smallest captured size >= n; the padding rows get slot -1 (the Triton store
skips them) and seq_len 0 (attention returns zeros), so they touch no real KV block. Only the Triton backend
is capturable: the torch backend plans on the host from `*_host` lists. Off on CPU: `maybe_capture` returns None.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..ops import AttentionMetadata

log = logging.getLogger("slofleet.engine.cuda_graphs")


def default_sizes(max_batch: int) -> list[int]:
    small = [s for s in (1, 2, 4, 8) if s < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size, vocab], rewritten by every replay of this graph


class DecodeGraphs:
    """Static input buffers shared by all captured sizes; graphs share one memory pool (they never overlap)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, max_batch: int, max_blocks: int, max_seq_len: int,
                 device: torch.device, sizes: list[int] | None = None):
        self.model, self.kv_caches = model, kv_caches
        self.max_blocks, self.max_seq_len = max_blocks, max_seq_len
        self.sizes = sorted(set(sizes or default_sizes(max_batch)))
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one query per sequence
        self.rows = torch.arange(n, dtype=torch.long, device=device)
        self.graphs: dict[int, _Captured] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        # max_seq_len is the longest context a replay may see, so the split-KV choice holds for all of them.
        return AttentionMetadata(self.slot_mapping[:size], self.query_start_loc[:size + 1], self.seq_lens[:size],
                                 self.block_tables[:size], 1, self.max_seq_len, [1] * size, [self.max_seq_len] * size)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size),
                          self.rows[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its pool
            self._forward(size)  # compile the kernels outside the capture; all rows are padding, so inert
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = _Captured(graph, logits)
        log.info("captured %d decode graphs (batch sizes %s) in %.1fs", len(self.sizes), self.sizes,
                 time.monotonic() - t0)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (meta.max_query_len == 1 and len(meta.seq_lens_host) <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.max_blocks and meta.max_seq_len <= self.max_seq_len)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] for a decode batch; valid until the next replay."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Columns past a table's width are never read: the kernels stop at seq_len.
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        self.graphs[size].graph.replay()
        return self.graphs[size].logits[:n]


def maybe_capture(model: torch.nn.Module, kv_caches: list, attention: object, max_batch: int, max_blocks: int,
                  max_seq_len: int, device: torch.device) -> DecodeGraphs | None:
    """Capture decode graphs where they apply (CUDA and the Triton backend); None elsewhere."""
    if device.type != "cuda":
        return None  # before importing triton: on CPU it must stay unimported (TRITON_INTERPRET is read once)
    from .attention import TritonAttention
    if not isinstance(attention, TritonAttention):
        return None
    graphs = DecodeGraphs(model, kv_caches, max_batch, max_blocks, max_seq_len, device)
    graphs.capture()
    return graphs
