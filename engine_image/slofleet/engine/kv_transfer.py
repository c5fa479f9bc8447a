"""KV hand-off between engines (prefill -> decode): the payload, and its wire format.

A prefill engine computes a prompt, samples the first token, and exports the prompt's KV blocks with the
token ids and a hash per full block. A decode engine imports them into its own pool and continues as if
it had prefilled (0 prompt tokens computed). The wire format is a length-prefixed JSON header followed by
the raw K and V bytes; HTTP carries it on CPU, and an NCCL/NIXL transport can move the same tensors.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .backends.cpu.dtype_probe import DTYPES
from .errors import UpstreamError

if TYPE_CHECKING:
    from .request import Request
    from .runner import ModelRunner



@dataclass(slots=True, kw_only=True)
class KVPayload:
    prompt_token_ids: list[int]
    first_token: int
    first_logprobs: dict[int, float] | None
    block_hashes: list[str]  # hex, one per full block: the receiver checks them against the tokens
    block_size: int
    k: torch.Tensor  # [layers, blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    def to_bytes(self) -> bytes:
        header = {"prompt_token_ids": self.prompt_token_ids, "first_token": self.first_token,
                  "first_logprobs": None if self.first_logprobs is None else
                  {str(t): lp for t, lp in self.first_logprobs.items()},
                  "block_hashes": self.block_hashes, "block_size": self.block_size, "shape": list(self.k.shape),
                  "dtype": str(self.k.dtype).removeprefix("torch.")}
        head = json.dumps(header).encode()
        k = self.k.contiguous().view(torch.uint8).numpy().tobytes()
        v = self.v.contiguous().view(torch.uint8).numpy().tobytes()
        return struct.pack("<I", len(head)) + head + k + v

    @classmethod
    def from_bytes(cls, data: bytes) -> KVPayload:
        """Parse a peer's payload; anything malformed is the peer's fault (UpstreamError, 502)."""
        try:
            (n,) = struct.unpack_from("<I", data)
            h = json.loads(data[4:4 + n])
            dtype = DTYPES[h["dtype"]]
            shape = tuple(int(x) for x in h["shape"])
            body = torch.frombuffer(bytearray(data[4 + n:]), dtype=torch.uint8)
            half = body.numel() // 2
            if body.numel() % 2 or half != torch.Size(shape).numel() * dtype.itemsize:
                raise ValueError(f"{body.numel()} bytes of K and V do not fit the shape {list(shape)}")
            k, v = body[:half].view(dtype).view(shape), body[half:].view(dtype).view(shape)
            lps = h["first_logprobs"]
            return cls(prompt_token_ids=[int(t) for t in h["prompt_token_ids"]], first_token=int(h["first_token"]),
                       first_logprobs=None if lps is None else {int(t): float(x) for t, x in lps.items()},
                       block_hashes=[str(x) for x in h["block_hashes"]], block_size=int(h["block_size"]), k=k, v=v)
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError,
                AttributeError, RuntimeError) as e:
            raise UpstreamError(f"the KV payload is malformed: {e}") from e

    def check(self, *, num_layers: int, kv_shape: tuple[int, int, int], hashes: list[bytes]) -> None:
        """Refuse a payload that does not fit this engine or its own tokens, before any block is touched.
        kv_shape: (block_size, kv_heads, head_dim); hashes: this engine's chain over the prompt's full blocks."""
        blocks = -(-len(self.prompt_token_ids) // kv_shape[0])
        want = (num_layers, blocks, *kv_shape)
        problems = [
            (self.block_size != kv_shape[0], f"block size {self.block_size}, this engine uses {kv_shape[0]}"),
            (tuple(self.k.shape) != want or tuple(self.v.shape) != want,
             f"K/V of shape {list(self.k.shape)}, this engine needs {list(want)}"),
            (self.block_hashes != [h.hex() for h in hashes], "block hashes that do not match its prompt tokens"),
        ]
        for bad, what in problems:
            if bad:
                raise UpstreamError(f"the KV payload has {what}")


def export(runner: ModelRunner, table: list[int], req: Request) -> KVPayload:
    """A finished prefill's prompt KV (prefill role), with the hashes of its full blocks."""
    bs = runner.block_size
    k, v = runner.read_kv(table[:-(-req.num_prompt_tokens // bs)])
    return KVPayload(prompt_token_ids=req.prompt_token_ids, first_token=req.output_token_ids[0],
                     first_logprobs=req.output_logprobs[0] if req.output_logprobs else None,
                     block_hashes=[h.hex() for h in req.block_hashes[:req.num_prompt_tokens // bs]],
                     block_size=bs, k=k, v=v)
