"""TEST-ONLY: one container of a pod as a local process (for noderunner.py)."""
from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Container:
    name: str
    argv: list[str]
    env: dict[str, str]
    probe_url: str | None
    log: Path
    pidfile: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: str = ""
    ready: bool = False
    next_start: float = 0.0
    # An exec readiness probe: run every `period` seconds in the container's environment, never waited on inside a
    # sync round (vLLM's asks its own /v1/models through a Python one-liner).
    probe_cmd: list[str] | None = None
    probe_period: float = 10.0
    probe_timeout: float = 1.0
    probing: subprocess.Popen | None = None
    probe_started: float = 0.0

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            try:
                # A session of its own per container: stopping a pod stops its whole process tree.
                self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:
                out.write(f"noderunner: cannot start {self.argv}: {e}\n".encode())
                self.proc, self.next_start = None, time.monotonic() + 5
                return
        self.pidfile.write_text(str(self.proc.pid))
        self.started_at, self.ready = now(), False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self) -> int | None:
        """The exit code once it has ended (None while it runs or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def probe(self) -> bool:
        if not self.running():
            return False
        if self.probe_cmd is not None:
            return self.probe_exec()
        if self.probe_url is None:
            return True
        try:
            with urllib.request.urlopen(self.probe_url, timeout=1) as r:
                return 200 <= r.status < 400
        except OSError:
            return False

    def probe_exec(self) -> bool:
        t = time.monotonic()
        if self.probing is None:
            if t - self.probe_started >= self.probe_period:
                self.probe_started = t
                try:
                    self.probing = subprocess.Popen(self.probe_cmd, env=self.env, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                                    start_new_session=True)
                except OSError:  # its program is not there: a failed probe, as the kubelet counts it
                    return False
            return self.ready
        if (rc := self.probing.poll()) is None:
            if t - self.probe_started < self.probe_timeout:
                return self.ready
            os.killpg(self.probing.pid, signal.SIGKILL)
            self.probing.wait()
        self.probing = None
        return rc == 0

    def stop(self, grace: float) -> None:
        if self.probing is not None and self.probing.poll() is None:
            os.killpg(self.probing.pid, signal.SIGKILL)
            self.probing.wait()
        self.probing = None
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.pidfile.unlink(missing_ok=True)
