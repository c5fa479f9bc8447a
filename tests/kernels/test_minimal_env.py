"""The engine core imports with torch, triton and transformers alone, as on the GPU machine (ARCHITECTURE.md)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

BLOCKED = ("fastapi", "pydantic", "prometheus_client", "gguf", "zmq", "msgpack", "cbor2")

SCRIPT = textwrap.dedent(f"""
    import sys

    class Absent:
        # Behave as if these packages were not installed at all.
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Absent())
    import slofleet.engine
    from slofleet.engine.backends.torch.attention import TorchAttention
    from slofleet.engine.backends.triton.cuda_graphs import DecodeGraphs
    from slofleet.engine.engine import LLMEngine
    from slofleet.engine.backends.triton.attention import TritonAttention

    TorchAttention(16), TritonAttention(16)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r})
    assert not leaked, leaked
    print("ok")
""")


def test_engine_core_imports_without_server_packages():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
