"""A `slofleet router` subprocess on a free loopback port, for the tests of every package that need one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support import ROOT
from tests.support.server import free_port, wait_http


class RouterProc:
    def __init__(self, *flags: str, log: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "slofleet.cli", "router", "--port", str(self.port), "--health-interval", "0.2",
               "--replica-header", "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def wait_ready(self, timeout: float = 60, path: str = "/ready") -> RouterProc:
        """Ready = it answers and sees at least one ready replica (path /health: it answers)."""
        try:
            wait_http(self.proc, self.url + path, self.log, timeout, "router", pause=0.1)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families
        out = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=5).text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
        return out
