"""Building and opening the engine's CPU kernels (cpu_kernels.py wraps the calls into them).

They are plain C++, not a torch extension, so building takes seconds with the system's compiler and needs no torch
headers or ninja; the shared object is cached under `$SLOFLEET_CACHE/kernels`, keyed by the sources and the CPU,
since it is built for the CPU it runs on (-march=native). It uses torch's own OpenMP runtime (torch loads libgomp
first), so its threads are torch's. Where no compiler is found or the build fails, `load()` answers None and the
torch ops run as before; the log says why once.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ...loader import cache_root

log = logging.getLogger("slofleet.engine.kernel")
HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("paged_attention.cpp", "prefill_attention.cpp", "tile_attention.cpp",
                                    "fused_ops.cpp", "small_gemm.cpp", "tile_gemm.cpp", "dot_gemm.cpp",
                                    "layer_stack.cpp")]
HEADERS = [HERE / "cpu_kernels.h", HERE / "forms.h", HERE / "decode_tiles.h"]
# No contraction of a * b + c into one FMA: the torch ops these replace round the product first.
FLAGS = ["-std=c++17", "-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fopenmp", "-fPIC",
         "-shared"]
FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides which kernels build and which dtype is fast
DISABLE = "SLOFLEET_NO_KERNELS"  # set to 1 to run the torch ops (a comparison, or a machine whose build misbehaves)

_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
_ATTENTION = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i32, _ptr, _ptr, _ptr, _ptr, _i32, _i32, _i32, _i32,
              _f32, _i32, _i32]
SIGNATURES = {
    "paged_decode": _ATTENTION,
    "paged_prefill": _ATTENTION,
    "tile_prefill": _ATTENTION,
    "add_rms_norm": [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _f32, _i32, _i32],
    "rope": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i32, _i32],
    "kv_store": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i32],
    "silu_mul_bf16": [_ptr, _i64, _ptr, _i64, _i64, _i32],
    "silu_mul_fp32": [_ptr, _i64, _ptr, _i64, _i64, _i32],
    "set_silu_exp": [_ptr, _i32],
    "small_gemm": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i32],
    "form_gemm": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i32, _i32],
    "gemm_panel_columns": [],
    "tile_enable": [],
    "tile_pack": [_ptr, _i64, _i64, _i32, _ptr],
    "tile_gemm": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i32, _i32, _i32],
    "form_unpack": [_ptr, _i64, _i64, _i32, _ptr, _i32],
    "dot_gemm": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i32, _i32, _i32],
    "layer_stack": [_ptr, _ptr, _i64, _ptr],
    "argmax_rows": [_ptr, _i64, _i64, _i64, _i32, _ptr, _i32],
}

def cpu_model() -> str:
    """The CPU's model name and the features that matter here: machines sold under one name differ in them."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return " ".join([name, *(f for f in FEATURES if f in flags)])


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build(out: Path, flags: list[str] = FLAGS, sources: list[Path] | None = None) -> None:
    """The kernels' shared object at out, from SOURCES (or `sources`: another revision's, for a benchmark)."""
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (c++ or g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # a whole file or none: builds may race
        part = Path(tmp) / out.name
        subprocess.run([cxx, *flags, *map(str, sources or SOURCES), "-o", str(part)], check=True, capture_output=True,
                       text=True, timeout=180)
        os.replace(part, out)


@functools.cache
def load() -> ctypes.CDLL | None:
    if os.environ.get(DISABLE) == "1":
        return None
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(FLAGS).encode()
    key = hashlib.sha256(text + cpu_model().encode() + torch.__version__.encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"cpu_kernels-{key}.so"
    try:
        if not path.exists():
            build(path)
        lib = open_library(path)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("CPU kernels unavailable, using torch ops: %s", str(detail).strip()[:300])
        return None
    log.info("CPU kernels: %s", path)
    return lib


def open_library(path: Path) -> ctypes.CDLL:
    """The kernels at path, with this process granted the tile registers where the CPU has them: a kernel that runs
    either way (decode attention) then takes the same path in every call, whoever asked for tiles() first."""
    lib = ctypes.CDLL(str(path))
    for name, args in SIGNATURES.items():
        getattr(lib, name).argtypes = args
    lib.tile_enable()
    return lib
