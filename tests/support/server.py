"""Start a real `slofleet serve` process on a free loopback port for API tests."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn

from slofleet.api.contract import INTERNAL_TOKEN_ENV
from tests.support import ROOT


def ephemeral_floor() -> int:
    """The first port the kernel hands out on its own (to bind(0) and to outgoing connections)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


HANDED_OUT: set[int] = set()


def free_port(n: int = 1) -> int:
    """The first of n consecutive loopback ports free now, below the ephemeral range: a port bind(0) picked could be
    taken, before a slow server binds it, by any outgoing connection on the machine (an engine's 30 s start lost its
    port that way in CI). Never the same port twice in one test process."""
    top = ephemeral_floor() - n
    for _ in range(1000):
        first = random.randrange(10_000, top)
        ports = range(first, first + n)
        if HANDED_OUT.intersection(ports):
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        HANDED_OUT.update(ports)
        return first
    raise RuntimeError("no free loopback ports below the ephemeral range")


def wait_http(proc: subprocess.Popen, url: str, log: Path, timeout: float, what: str, pause: float = 0.3) -> None:
    """Poll `url` until it answers 200; fail at once with the log's tail if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(pause)
    raise TimeoutError(f"{what} not ready in {timeout}s:\n{log.read_text()[-3000:]}")


INTERNAL_TOKEN = "test-internal-token"  # what the operator's Secret holds in a cluster


class Server:
    def __init__(self, *flags: str, log: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "slofleet.cli", "serve", "--port", str(self.port), "--dtype", "float32", *flags]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def wait_ready(self, timeout: float = 180) -> None:
        wait_http(self.proc, self.url + "/ready", self.log, timeout, "server")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{labels}': value}, parsed with prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families
        out = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=5).text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}"] = s.value
        return out


@contextlib.contextmanager
def serving(*flags: str, log: Path) -> Iterator[Server]:
    """A `slofleet serve` with these flags, ready, stopped on the way out (a module fixture's whole body)."""
    srv = Server(*flags, log=log)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def prefill_decode_pair(folder: Path, *flags: str) -> Iterator[tuple[Server, Server]]:
    """A prefill and a decode engine process of one service (sharing its internal token), both ready; stopped on
    exit."""
    env = {INTERNAL_TOKEN_ENV: INTERNAL_TOKEN}
    pre = Server("--role", "prefill", *flags, log=folder / "prefill.log", env=env)
    dec = Server("--role", "decode", *flags, log=folder / "decode.log", env=env)
    try:
        pre.wait_ready()
        dec.wait_ready()
        yield pre, dec
    finally:
        pre.stop()
        dec.stop()


def serve_in_thread(app, port: int | None = None) -> tuple[uvicorn.Server, threading.Thread, str]:
    """An ASGI app (a test stand-in, or the engine's own app) served by uvicorn in a daemon thread of this process,
    on loopback; returns once it listens. Stop it with `server.should_exit = True`, then join the thread."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", interface="asgi3"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"
