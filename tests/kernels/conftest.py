"""Kernel tests run under the Triton interpreter on CPU and compiled on a GPU.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, before any test imports
the kernels (slofleet.engine.triton_attention also sets it on import where there is no GPU).
A GPU run (benchmarks/gpu_check.py) sets TRITON_INTERPRET=0 itself.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
