"""The in-place paged decode-attention kernel (paged_attention.cpp): compiled once per machine, called with ctypes.

It is plain C++, not a torch extension, so building takes seconds with the system's compiler and needs no torch
headers or ninja; the shared object is cached under `$SLOFLEET_CACHE/kernels`, keyed by the source and the CPU, since it
is built for the CPU it runs on (-march=native). It uses torch's own OpenMP runtime (torch loads libgomp first), so
its threads are torch's. Where no compiler is found or the build fails, `load()` answers None and the torch
attention path runs as before; the log says why once.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .dtype_probe import cpu_model
from .loader import cache_root

log = logging.getLogger("slofleet.engine.kernel")
SOURCE = Path(__file__).with_name("paged_attention.cpp")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM, MAX_GROUP = 256, 16  # the kernel's stack buffers
DISABLE = "SLOFLEET_NO_KERNELS"  # set to 1 to run the torch path (a comparison, or a machine whose build misbehaves)

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
ARGTYPES = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i32, _ptr, _ptr, _ptr, _ptr,
            _i32, _i32, _i32, _i32, ctypes.c_float, _i32, _i32]


def build(out: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (c++ or g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # a whole file or none: builds may race
        part = Path(tmp) / out.name
        subprocess.run([cxx, "-std=c++17", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", str(SOURCE),
                        "-o", str(part)], check=True, capture_output=True, text=True, timeout=120)
        os.replace(part, out)


@functools.cache
def load() -> ctypes.CDLL | None:
    if os.environ.get(DISABLE) == "1":
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + cpu_model().encode() + torch.__version__.encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"paged_attention-{key}.so"
    try:
        if not path.exists():
            build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("paged decode-attention kernel unavailable, using the torch path: %s", str(detail).strip()[:300])
        return None
    lib.paged_decode.argtypes = ARGTYPES
    lib.paged_decode.restype = ctypes.c_int
    log.info("paged decode-attention kernel: %s", path)
    return lib


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this layer's shapes (else the torch path does)."""
    heads, kv_heads, d = q.shape[1], k_cache.shape[2], q.shape[2]
    return (q.device.type == "cpu" and q.dtype in DTYPES and k_cache.dtype == q.dtype and q.stride(-1) == 1
            and k_cache.is_contiguous() and d <= MAX_HEAD_DIM and heads % kv_heads == 0
            and heads // kv_heads <= MAX_GROUP and load() is not None)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           rows: torch.Tensor, query_start: torch.Tensor, query_len: torch.Tensor, seq_len: torch.Tensor,
           out: torch.Tensor, scale: float) -> None:
    """Attention of `rows` (int32 batch rows, each a few query tokens over its cached context) into out's tokens.
    block_tables, query_start, query_len and seq_len are int32 and contiguous, one entry per batch row."""
    heads, d = q.shape[1], q.shape[2]
    rc = load().paged_decode(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                             block_tables.data_ptr(), block_tables.stride(0), rows.data_ptr(), len(rows),
                             query_start.data_ptr(), query_len.data_ptr(), seq_len.data_ptr(), out.data_ptr(),
                             heads, k_cache.shape[2], d, k_cache.shape[1], scale, DTYPES[q.dtype],
                             torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged decode kernel refused heads={heads} kv_heads={k_cache.shape[2]} head_dim={d}")
