"""A CPU engine keeps the memory its steps free (runner.keep_freed_memory), rather than giving it back to the kernel
and faulting it in again, zeroed, in the next step: measured on the layers' loop, whose many tensors a step fault in
afresh without it (the layer stack, which allocates a step's few buffers once each, faulted in none either way)."""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="it sets glibc's allocator")

# Page faults of the generate() calls after a first in a fresh process: the first has sized the heap (or not). The
# fewest of three, since the heap may still grow by a few MB in a later call whose frees came in another order.
SCRIPT = """
import json, resource, sys
from slofleet.engine import LLM, SamplingParams, runner
from slofleet.engine.backends.cpu.ops import CpuOps
if sys.argv[1] == "off":
    runner.keep_freed_memory = lambda: False
# finding them at load leaves a heap the steps reuse even without the setting
CpuOps.forms = lambda self, model, dtype: {}
llm = LLM(dtype="float32")
llm.engine.runner.model.stack = None  # the layers' loop: the layer stack's few step buffers fault little either way
prompts = [[1 + (i * 7 + j) % 400 for j in range(200 + 40 * i)] for i in range(4)]
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
llm.generate(prompts, params)
counts = []
for k in range(1, 4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate([[p[0] + k, *p[1:]] for p in prompts], params)
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(min(counts)))
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_steps_reuse_the_memory_earlier_steps_freed():
    kept, given_back = faults("on"), faults("off")
    assert given_back > 1000, "without it, each step's activations are faulted in afresh"
    assert kept * 10 < given_back, (kept, given_back)
