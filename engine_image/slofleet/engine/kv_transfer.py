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

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
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
        (n,) = struct.unpack_from("<I", data)
        h = json.loads(data[4:4 + n])
        dtype = _DTYPES[h["dtype"]]
        body = torch.frombuffer(bytearray(data[4 + n:]), dtype=torch.uint8)
        if body.numel() % 2:
            raise ValueError("KV payload is truncated")
        half = body.numel() // 2
        shape = tuple(h["shape"])
        k, v = body[:half].view(dtype).view(shape), body[half:].view(dtype).view(shape)
        lps = h["first_logprobs"]
        return cls(h["prompt_token_ids"], h["first_token"], None if lps is None else {int(t): x for t, x in lps.items()},
                   h["block_hashes"], h["block_size"], k, v)
