"""Kernel tests run under the Triton interpreter on CPU and compiled on a GPU.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, before any test imports
the kernels (slofleet.engine.backends.triton.attention also sets it on import where there is no GPU).
A GPU run (benchmarks/gpu_check.py) sets TRITON_INTERPRET=0 itself. The fixtures build the CPU kernels again without
one of this CPU's features, so one machine checks the paths of CPUs without it too.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def variant(tmp_path_factory, feature: str, flags: list[str], why: str):
    """The kernels built again without the CPU's `feature` (by `flags`), or a skip saying `why` where it has none."""
    from slofleet.engine.backends.cpu import cpu_kernels, dtype_probe  # after TRITON_INTERPRET is set
    if feature not in dtype_probe.cpu_model().split():
        pytest.skip(why)
    path = tmp_path_factory.mktemp("kernels") / f"no-{feature}.so"
    cpu_kernels.build(path, [*cpu_kernels.FLAGS, *flags])
    return cpu_kernels.open_library(path)


@pytest.fixture(scope="session")
def avx2_build(tmp_path_factory):
    """On an AVX-512 CPU, the kernels also built as for an AVX2 one, so one machine checks both vector widths."""
    return variant(tmp_path_factory, "avx512f", ["-mno-avx512f"],
                   "no AVX-512 here: the native build is the AVX2 one (or plain loops), checked above")


@pytest.fixture(scope="session")
def no_amx_build(tmp_path_factory):
    """On an AMX CPU, the kernels also built without the tile unit, as for an AVX512-BF16 CPU without it, whose build
    an AMX machine would otherwise never compile (the tile paths are templates its build instantiates)."""
    return variant(tmp_path_factory, "amx_bf16", ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
                   "no AMX here: the native build is the one without tiles, checked above")


@pytest.fixture(scope="session")
def no_bf16_dot_build(tmp_path_factory):
    """On an AVX512-BF16 CPU, the kernels also built without that extension: a bf16 cache then takes the widening
    attention templates, as on AVX-512 CPUs before it, rather than the bf16 dot product."""
    return variant(tmp_path_factory, "avx512_bf16", ["-mno-avx512bf16"],
                   "no AVX512-BF16 here: the native build is the widening one, checked above")
