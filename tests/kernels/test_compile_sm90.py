"""The kernels compile for an H100/H200 (sm_90) without register spills: catches what the interpreter cannot
(unsupported constructs, type errors in the compiled path) on machines with no GPU. Needs only triton's
bundled ptxas and cuobjdump."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

SCRIPT = textwrap.dedent("""
    import re, subprocess, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from slofleet.engine.backends.triton import attention as ta

    attn = ta.TritonAttention(16)
    types = dict.fromkeys(("out", "q", "k_cache", "v_cache", "k", "v"), "*bf16")
    types.update(block_tables="*i32", seq_lens="*i32", query_start_loc="*i32", slots="*i64", qk_scale="fp32",
                 part_out="*fp32", part_lse="*fp32")
    attn_consts = dict(GROUP=4, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, UPCAST=True, PRECISION="tf32")
    cases = [  # the shapes of a 1B-class Llama (32/8 heads, head_dim 128) in bf16
        (ta._store_kv, dict(KVH=8, HEAD_DIM=128, KVH_PAD=8, D_PAD=128), 4),
        (ta._paged_attention, dict(attn_consts, BLOCK_M=64, BLOCK_Q=16, BLOCK_N=32), 4),
        (ta._paged_attention, dict(attn_consts, BLOCK_M=16, BLOCK_Q=4, BLOCK_N=attn.decode_tile), attn.decode_warps),
        (ta._split_kv_decode, dict(attn_consts, BLOCK_M=16, BLOCK_N=attn.decode_tile, NUM_SPLITS=4), attn.decode_warps),
        (ta._merge_splits, dict(HEAD_DIM=128, D_PAD=128, NUM_SPLITS=4, S_PAD=4), 4),
    ]
    for fn, consts, warps in cases:
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([sys.argv[1], "-res-usage", f.name], capture_output=True, text=True).stdout
        regs, stack = (int(re.search(key + r":(\\d+)", usage).group(1)) for key in ("REG", "STACK"))
        print(fn.__name__, consts.get("BLOCK_N"), warps, "regs", regs, "stack", stack)
        assert stack == 0, f"{fn.__name__} spills {stack} bytes"
""")


@pytest.mark.skipif(not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
                    reason="triton's bundled CUDA tools are absent")
def test_kernels_compile_for_sm90_without_spills():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(BIN / "cuobjdump")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
