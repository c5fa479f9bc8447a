"""containerd (Debian's, with runc) and a standalone kubelet (tools/kubelet) on this machine, for the tests that run
pods as real containers, and `make image`'s containerd. Root only.

The settings this host needs (cgroup v1, no systemd): the kubelet with failCgroupV1 false and the cgroupfs driver;
containerd with restrict_oom_score_adj (else runc fails: "can't get final child's PID from pipe: EOF") and a pause
image built here (tools/image/build.sh), as no registry is reachable. containerd's root (images, snapshots) is
cached under ~/.cache/slofleet/containerd, so the engine image built once serves every later run.

    python -m tests.support.containers image   # `make image`: start containerd, build and import the images
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import ROOT
from tests.support.server import free_port

CACHE = Path(os.environ.get("SLOFLEET_CONTAINERD_CACHE", Path.home() / ".cache" / "slofleet" / "containerd"))
PAUSE_IMAGE = "docker.io/slofleet/pause:local"
IMAGE_BUILD = ROOT / "tools" / "image" / "build.sh"
KUBELET_BUILD = ROOT / "tools" / "kubelet" / "build.sh"


def missing() -> str | None:
    """Why containers cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("containerd", "runc", "ctr", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: make containerd"
    return None


@dataclass(slots=True, kw_only=True)
class Containerd:
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="slofleet-containerd-")))
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return str(self.folder / "containerd.sock")

    def config(self) -> str:
        text = subprocess.run(["containerd", "config", "default"], capture_output=True, text=True, check=True).stdout
        edits = {r"^root = .*$": f'root = "{CACHE / "root"}"', r"^state = .*$": f'state = "{self.folder / "state"}"',
                 r'^(\s*)address = "/run/containerd/containerd.sock"': rf'\1address = "{self.address}"',
                 r"^(\s*)restrict_oom_score_adj = .*$": r"\1restrict_oom_score_adj = true",
                 r"^(\s*)sandbox_image = .*$": rf'\1sandbox_image = "{PAUSE_IMAGE}"'}
        for pattern, repl in edits.items():
            text, n = re.subn(pattern, repl, text, count=1, flags=re.M)
            assert n == 1, f"containerd's default config has no line {pattern!r}"
        return text

    def start(self) -> Containerd:
        (self.folder / "config.toml").write_text(self.config())
        log = open(self.folder / "containerd.log", "wb")
        self.proc = subprocess.Popen(["containerd", "--config", str(self.folder / "config.toml")], stdout=log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while subprocess.run(["ctr", "-a", self.address, "version"], capture_output=True).returncode:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        return self

    def log(self) -> str:
        return (self.folder / "containerd.log").read_text(errors="replace")

    def ctr(self, *args: str) -> str:
        return subprocess.run(["ctr", "-a", self.address, "-n", "k8s.io", *args], capture_output=True, text=True,
                              timeout=60).stdout

    def tasks(self) -> list[str]:
        return self.ctr("tasks", "ls", "-q").split()

    def stop(self) -> None:
        """Kill what still runs (a kubelet leaves pod sandboxes), then containerd, then unmount its state."""
        for task in self.tasks():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task)
        deadline = time.monotonic() + 30
        while self.tasks() and time.monotonic() < deadline:
            time.sleep(0.5)
        for task in self.ctr("containers", "ls", "-q").split():
            self.ctr("tasks", "delete", "-f", task)
            self.ctr("containers", "delete", task)
        end(self.proc, self.folder)


def end(proc: subprocess.Popen | None, folder: Path) -> None:
    """Stop a daemon, then unmount what it left under its folder and remove the folder."""
    if proc and proc.poll() is None:
        proc.terminate()
        proc.wait(30)
    for mount in reversed(mounts_under(folder)):
        subprocess.run(["umount", "-l", mount], capture_output=True)
    shutil.rmtree(folder, ignore_errors=True)


def mounts_under(folder: Path) -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(str(folder))]


@dataclass(slots=True, kw_only=True)
class Kubelet:
    """A kubelet without an API server: it runs the static pods written to its manifest folder."""
    binary: str
    runtime: Containerd
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="slofleet-kubelet-")))
    read_port: int = 0
    proc: subprocess.Popen | None = None

    def start(self) -> Kubelet:
        self.read_port = free_port()
        (self.folder / "manifests").mkdir()
        config = {"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
                  "failCgroupV1": False, "cgroupDriver": "cgroupfs",
                  "containerRuntimeEndpoint": f"unix://{self.runtime.address}",
                  "staticPodPath": str(self.folder / "manifests"), "address": "127.0.0.1",
                  "port": free_port(), "readOnlyPort": self.read_port, "healthzPort": free_port(),
                  "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
                  "authorization": {"mode": "AlwaysAllow"}, "failSwapOn": False, "resolvConf": "",
                  # A shared test machine: no evictions or image collection on its disk and memory pressure.
                  "evictionHard": {}, "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99}
        (self.folder / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
        log = open(self.folder / "kubelet.log", "wb")
        self.proc = subprocess.Popen([self.binary, "--config", str(self.folder / "config.yaml"), "--root-dir",
                                      str(self.folder / "root"), "--hostname-override", "slofleet-kubelet"],
                                     stdout=log, stderr=subprocess.STDOUT)
        return self

    def run(self, pod: dict) -> None:
        (self.folder / "manifests" / f"{pod['metadata']['name']}.json").write_text(json.dumps(pod))

    def pods(self) -> list[dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.read_port}/pods", timeout=5) as r:
            return json.loads(r.read())["items"]

    def log(self) -> str:
        return (self.folder / "kubelet.log").read_text(errors="replace")

    def stop(self) -> None:
        """Remove the static pods and wait until the kubelet has stopped their containers, then stop it."""
        for f in (self.folder / "manifests").glob("*.json"):
            f.unlink()
        deadline = time.monotonic() + 90  # the pods leave the kubelet's list before their containers stop
        while self.proc and self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if not self.pods() and not self.runtime.tasks():
                    break
            except OSError:
                pass
            time.sleep(0.5)
        end(self.proc, self.folder)


def build_image(python: str = sys.executable) -> int:
    """`make image`: containerd on the cached root, the engine and pause images built and imported into it."""
    why = missing()
    if why:
        print(f"make image: {why}", file=sys.stderr)
        return 1
    runtime = Containerd().start()
    try:
        env = {**os.environ, "PYTHON": python, "CONTAINERD_ADDRESS": runtime.address, "PAUSE_IMAGE": PAUSE_IMAGE}
        return subprocess.run([str(IMAGE_BUILD)], env=env).returncode
    finally:
        runtime.stop()


if __name__ == "__main__":
    if sys.argv[1:] != ["image"]:
        print("usage: python -m tests.support.containers image", file=sys.stderr)
        sys.exit(2)
    sys.exit(build_image())
