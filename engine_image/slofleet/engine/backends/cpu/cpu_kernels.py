"""The engine's CPU kernels (paged_attention.cpp, prefill_attention.cpp, tile_attention.cpp, fused_ops.cpp,
small_gemm.cpp, tile_gemm.cpp, dot_gemm.cpp, and layer_stack.cpp, which runs a step's layers through them), called
with ctypes on tensors: each op's check of what the kernel takes, and its call. Tensors are fp32 or bf16 on the CPU;
anything else takes torch, as does every op where the kernels did not build (kernel_library.load() is None).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from . import quant

# the library's names are cpu_kernels' too, for the tests and benchmarks that build other variants of it
from .kernel_library import FLAGS, HEADERS, HERE, SIGNATURES, SOURCES, build, compiler, load, open_library  # noqa: F401

log = logging.getLogger("slofleet.engine.kernel")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM, MAX_GROUP, MAX_ROPE_DIM = 256, 16, 1024  # the kernels' stack buffers
TILE = 32  # the bf16 kernels take N and K in multiples of this
# Rows up to which a bf16 kernel unpacks a quantised form's panels itself: the tile kernel once per chunk of 512 rows
# (tile_gemm.cpp) on their way to the tile unit, the dot-product kernel a group of panel pairs at a time for every row
# (dot_gemm.cpp); more unpack the whole weight into a buffer first (out to memory and back), which pays only from
# a few thousand rows on (docs/kernels-notes.md).
DIRECT_ROWS = 2048


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: on the CPU, one dtype they know, and built."""
    first = tensors[0]
    return (first.device.type == "cpu" and first.dtype in DTYPES and all(t.dtype == first.dtype for t in tensors)
            and load() is not None)


def attention_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the decode-attention kernel takes this layer's shapes (else the torch path does)."""
    heads, kv_heads, d = q.shape[1], k_cache.shape[2], q.shape[2]
    return (q.stride(-1) == 1 and k_cache.is_contiguous() and d <= MAX_HEAD_DIM and heads % kv_heads == 0
            and heads // kv_heads <= MAX_GROUP and usable(q, k_cache))


def prefill_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the prefill-attention kernel takes this layer's shapes (head size 64 or 128, a vector unit)."""
    return attention_usable(q, k_cache) and prefill_takes(q.shape[1], k_cache.shape[2], q.shape[2])


@functools.cache
def prefill_takes(heads: int, kv_heads: int, head_dim: int, kind: str = "paged_prefill") -> bool:
    """The kernel's own answer (a call with no rows), asked once per shape rather than every step."""
    return getattr(load(), kind)(None, 0, 0, None, None, None, 0, None, 0, None, None, None, None, heads, kv_heads,
                                 head_dim, 1, 1.0, 1, 1) == 0


def prefill_kernel(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str:
    """The prefill-attention kernel for these shapes: on AMX, bf16 with both products on the tiles."""
    if dtype == torch.bfloat16 and tiles() and prefill_takes(heads, kv_heads, head_dim, "tile_prefill"):
        return "tile_prefill"
    return "paged_prefill"


def attend(kind: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           rows: torch.Tensor, query_start: torch.Tensor, query_len: torch.Tensor, seq_len: torch.Tensor,
           out: torch.Tensor, scale: float) -> None:
    """Attention of `rows` (int32 batch rows over their cached context) into out's tokens, by the "decode" kernel
    (a few query tokens a row) or the "prefill" one (chunks). block_tables, query_start, query_len and seq_len are
    int32 and contiguous, one entry per batch row; the rows' new K/V are in the cache already."""
    heads, d = q.shape[1], q.shape[2]
    name = prefill_kernel(q.dtype, heads, k_cache.shape[2], d) if kind == "prefill" else "paged_decode"
    rc = getattr(load(), name)(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), rows.data_ptr(), len(rows), query_start.data_ptr(), query_len.data_ptr(),
        seq_len.data_ptr(), out.data_ptr(), heads, k_cache.shape[2], d, k_cache.shape[1], scale, DTYPES[q.dtype],
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged {kind} kernel refused heads={heads} kv_heads={k_cache.shape[2]} head_dim={d}")


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """Each row's first maximum of x [rows, n] (logits in the LM head's dtype), as torch.max(-1).indices gives it;
    None where the kernel does not take x or a row holds a NaN (torch's answer then depends on where it is)."""
    if x.dim() != 2 or x.stride(-1) != 1 or not usable(x):
        return None
    out = torch.empty(x.shape[0], dtype=torch.long)
    load().argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], DTYPES[x.dtype], out.data_ptr(),
                       torch.get_num_threads())
    return None if bool((out < 0).any()) else out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (delta may be strided), then RMSNorm(x) * weight into a new tensor."""
    out = torch.empty_like(x)
    y, ys = (delta.data_ptr(), delta.stride()) if delta is not None else (None, (0, 0))
    load().add_rms_norm(x.data_ptr(), y, ys[0], ys[1], weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                        eps, DTYPES[x.dtype], torch.get_num_threads())
    return out


@functools.cache
def has_silu() -> bool:
    """Whether the SiLU-and-mul kernel was built (it needs AVX-512): asked once, with no rows."""
    return load() is not None and load().silu_mul_bf16(None, 0, None, 0, 0, 1) == 0


# torch's vectorised fp32 exp at the CPU capability its kernels run (torch.backends.cpu), which its SiLU calls: Sleef's
TORCH_EXP = {"AVX2": ("Sleef_expf8_u10", 8), "AVX512": ("Sleef_expf16_u10", 16)}


@functools.cache
def has_silu_fp32() -> bool:
    """Whether fp32 SiLU-and-mul runs in the kernel: with torch's own vector exp, found in torch's library and taken
    by the kernel, and only where a probe's results are torch's bit for bit (else torch's ops run)."""
    name, lanes = TORCH_EXP.get(torch.backends.cpu.get_cpu_capability(), (None, 0))
    found = sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*"))
    if load() is None or name is None or not found:
        return False
    try:
        exp = ctypes.cast(getattr(ctypes.CDLL(str(found[0])), name), ctypes.c_void_p)
    except (OSError, AttributeError):
        return False
    if load().set_silu_exp(exp, lanes) != 0:
        return False
    spread = torch.randn(6000, generator=torch.Generator().manual_seed(0)) * 6
    probe = torch.cat((torch.linspace(-120.0, 100.0, 6000), spread)).reshape(3, 4000)  # 2,000 a row: a tail too
    gate, up = probe.chunk(2, dim=-1)
    if not torch.equal(silu_mul(probe), torch.nn.functional.silu(gate).mul_(up)):
        log.warning("fp32 SiLU with torch's %s differs from torch's own: torch's ops run", name)
        return False
    return True


def silu_usable(gate_up: torch.Tensor) -> bool:
    """Rows of a prefill chunk with a contiguous last dimension (a decode's product is column-major, and below ~8 rows
    a call costs more than torch's two ops): bf16 on AVX-512, fp32 where the kernel has torch's exp."""
    if gate_up.shape[0] < 8 or gate_up.stride(1) != 1 or not usable(gate_up):
        return False
    return has_silu_fp32() if gate_up.dtype == torch.float32 else has_silu()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [rows, 2 x inter] projection with contiguous rows (see silu_usable)."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    kernel = load().silu_mul_fp32 if gate_up.dtype == torch.float32 else load().silu_mul_bf16
    kernel(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


def rope_usable(qk: torch.Tensor) -> bool:
    return qk.stride(2) == 1 and qk.stride(1) == qk.shape[2] and qk.shape[2] <= MAX_ROPE_DIM and usable(qk)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [rows, heads, dim] (heads contiguous in a row) in place by contiguous fp32 cos/sin rows; returns it."""
    load().rope(qk.data_ptr(), qk.stride(0), cos.data_ptr(), sin.data_ptr(), qk.shape[0], qk.shape[1], qk.shape[2],
                DTYPES[qk.dtype], torch.get_num_threads())
    return qk


def kv_store_usable(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """[T, KVH, D] rows whose heads lie side by side, into a contiguous [blocks, block_size, KVH, D] cache of their
    dtype, by int64 slots."""
    return (all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v)) and k_cache.is_contiguous()
            and k_cache.shape[2:] == k.shape[1:] == v.shape[1:] and slots.dtype == torch.int64
            and slots.is_contiguous() and k.dtype == v.dtype == k_cache.dtype and usable(k, v, k_cache))


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
             ) -> None:
    """k and v's rows into the caches' slots (kv_store_usable's tensors; v_cache laid out as k_cache)."""
    es = k.element_size()
    load().kv_store(k.data_ptr(), k.stride(0) * es, v.data_ptr(), v.stride(0) * es, k_cache.data_ptr(),
                    v_cache.data_ptr(), slots.data_ptr(), k.shape[0], k.shape[1] * k.shape[2] * es,
                    torch.get_num_threads())


@functools.cache
def panel_columns() -> int:
    """Columns of W.T per packed panel (two vectors of this CPU's width); 0 where the GEMM kernel is not built."""
    return 0 if load() is None else load().gemm_panel_columns()


@functools.cache
def tiles() -> bool:
    """Whether the bf16 tile kernel runs here: a CPU with AMX-BF16 and a kernel that let this process use it."""
    return load() is not None and load().tile_enable() == 0


@functools.cache
def bf16_kernels() -> tuple[str, ...]:
    """The bf16 GEMM kernels this CPU runs, the faster first: "tile_gemm" on AMX, "dot_gemm" on AVX512-BF16 (the
    vector unit's bf16 dot product); both read the weights `pack` makes."""
    found = ("tile_gemm",) if tiles() else ()
    if load() is not None and load().dot_gemm(None, 0, None, None, 0, 0, TILE, 2, 0, 0, 1) == 0:  # no rows: asks only
        found += ("dot_gemm",)
    return found


def bf16_gemm() -> str | None:
    """The bf16 GEMM kernel the engine runs, or None where none is built (torch's bf16 GEMM runs)."""
    return next(iter(bf16_kernels()), None)


def panel_rows(n: int, paired: bool) -> torch.Tensor:
    """W's rows in the order the bf16 tiles hold them (tile_pack): 16 a panel; paired, panel 2q holds gate's rows
    16q.. and panel 2q + 1 up's same rows."""
    p = torch.arange(n // 16)
    first = (p % 2) * (n // 2) + (p // 2) * 16 if paired else p * 16
    return (first[:, None] + torch.arange(16)).reshape(-1)


@functools.cache
def unpacks(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a GEMM kernel of this dtype runs here on quantised forms (forms.h): bf16, either bf16 kernel (both
    need AVX512-BF16, which unpacks them); fp32, small_gemm's form_gemm (AVX-512, or AVX2 with F16C)."""
    if dtype == torch.float32:
        return load() is not None and load().form_gemm(None, 0, None, None, 0, 0, 0, 1, 1) == 0  # no weight: asks
    return dtype == torch.bfloat16 and bf16_gemm() is not None and load().form_unpack(None, 0, 0, 1, None, 1) == 0


def pack(weight: torch.Tensor, paired: bool = False, form: quant.Form | None = None) -> torch.Tensor | None:
    """A CPU weight W [N, K] as a GEMM kernel reads it: fp32 as [N / C, K, C] panels of W.T (small_gemm.cpp), bf16
    as [N / 16, K / 2, 16, 2] tiles of pairs (tile_gemm.cpp on AMX, dot_gemm.cpp on AVX512-BF16), or, given W's
    exact GGUF form (quant.recover) where a kernel of W's dtype unpacks it (`unpacks`), that form's bytes: bf16,
    [N / 16, K / 32, step], which the tile kernel unpacks to the same tiles; fp32, [N / C, K / 32, C / 16, step] (the
    16-column steps of each fp32 panel side by side), which form_gemm unpacks to the same panels. None
    where no kernel takes it (another dtype or device, no kernel for this CPU, N or K off the kernel's multiple):
    torch's GEMM runs. `paired`: W is a SwiGLU's [gate; up]; bf16 tiles then pair each gate column with its up
    column, for gemm(..., silu=True)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        if bf16_gemm() is None or n % TILE or k % TILE:
            return None
        if form is not None and unpacks():
            return quant.layout(form, panel_rows(n, paired))
        w = weight.detach().contiguous()
        out = torch.empty((n // 16, k // 2, 16, 2), dtype=torch.bfloat16)
        load().tile_pack(w.data_ptr(), n, k, int(paired), out.data_ptr())
        return out
    c = panel_columns()
    if not c or weight.dtype != torch.float32 or n % c:
        return None
    if form is not None and unpacks(torch.float32) and n % TILE == 0 and k % TILE == 0:
        steps = quant.layout(form, panel_rows(n, False))
        return steps.view(n // c, c // 16, *steps.shape[1:]).transpose(1, 2).contiguous()
    return weight.detach().reshape(n // c, c, k).transpose(1, 2).contiguous()


FORM_BY_STEP = {quant.STEP_BYTES[kind]: i for i, kind in enumerate(quant.KINDS, 1)}  # forms.h's Form numbers


def form_of(panels: torch.Tensor) -> int:
    """forms.h's Form of a packed weight (by the bytes of its steps): 0 for plain panels or tiles."""
    return FORM_BY_STEP[panels.shape[-1]] if panels.dtype == torch.uint8 else 0


def form_dtype(panels: torch.Tensor) -> torch.dtype:
    """The dtype of the rows a packed weight's kernel takes: a form's (fp32 forms have a dimension more), or its own."""
    if panels.dtype == torch.uint8:
        return torch.float32 if panels.dim() == 4 else torch.bfloat16
    return panels.dtype


def shape(panels: torch.Tensor) -> tuple[int, int]:
    """(N, K) of the weight behind a packed weight."""
    if panels.dtype == torch.uint8:
        return panels.numel() // (panels.shape[1] * panels.shape[-1]) * 16, panels.shape[1] * quant.BLOCK
    if panels.dtype == torch.bfloat16:
        return panels.shape[0] * 16, panels.shape[1] * 2
    return panels.shape[0] * panels.shape[2], panels.shape[1]


def unpack(panels: torch.Tensor) -> torch.Tensor:
    """A packed form's bf16 tiles, bit for bit those pack() makes of the weight it gives back."""
    n, k = shape(panels)
    out = torch.empty((n // 16, k // 2, 16, 2), dtype=torch.bfloat16)
    if load().form_unpack(panels.data_ptr(), n, k, form_of(panels), out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError("this CPU has no kernel to unpack quantised weights")
    return out


def gemm(x: torch.Tensor, panels: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """x [M, K] @ W.T from W's packed form (`pack`: the dtype of x, or a quantised form packed for it), into a new
    contiguous [M, N]; with `silu` (bf16 tiles or a form packed paired), silu(gate) * up [M, N / 2] instead, rounded
    as torch's ops round it."""
    form, dtype = form_of(panels), form_dtype(panels)
    if form and dtype == torch.bfloat16 and x.shape[0] > DIRECT_ROWS:
        panels, form = unpack(panels), 0
    bf16 = dtype == torch.bfloat16
    n, k = shape(panels)
    if x.shape[-1] != k or x.dim() != 2 or x.dtype != dtype or (silu and not bf16):
        raise ValueError(f"x {list(x.shape)} {x.dtype} does not fit panels {list(panels.shape)} {panels.dtype}"
                         f"{' with silu' if silu else ''}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((x.shape[0], n // 2 if silu else n), dtype=x.dtype)
    if form and not bf16:
        done = load().form_gemm(x.data_ptr(), x.stride(0), panels.data_ptr(), y.data_ptr(), x.shape[0], n, k, form,
                                torch.get_num_threads())
    elif bf16:
        args = (x.data_ptr(), x.stride(0), panels.data_ptr(), y.data_ptr(), y.shape[1], x.shape[0], n, k, int(silu))
        if bf16_gemm() == "tile_gemm":
            done = load().tile_gemm(*args, form, torch.get_num_threads())
        else:
            done = load().dot_gemm(*args, form, torch.get_num_threads())
    else:
        done = load().small_gemm(x.data_ptr(), x.stride(0), panels.data_ptr(), y.data_ptr(), x.shape[0], n, k,
                                 torch.get_num_threads())
    if done != 0:  # panels not made by pack(): y would be left unwritten
        raise ValueError(f"panels {list(panels.shape)} {panels.dtype} are not a shape the kernel takes")
    return y
