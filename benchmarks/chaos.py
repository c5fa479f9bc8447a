"""Chaos: the load mix through the router in front of real engines on loopback, while one fault at a time hits one
engine, and per fault what the clients saw.

Faults: `kill` (SIGKILL mid-load; the engine restarts on its port, with a new KV events epoch), `hang` (SIGSTOP
for --hang-seconds, then SIGCONT: the router's per-try limit and idle timeout, not the client's, end the wait),
`drain` (SIGTERM mid-load: 503 while draining, then exit and restart), `refuse` (killed just before the load, so
the first tries meet a refused connection before a probe notices), `kill-both-restart` (one engine killed, then
the other while the first restarts: requests wait for a ready replica).

Per fault: requests sent; succeeded ([DONE] after tokens, no error); retried and failed over (the router's
counters); cut (started, then ended with a visible error event); refused (429, told to retry); unserved (503
after the router held it for a ready engine while none was: only when every engine is down); lost (any other error
before the first token: must be 0); hung (no terminal event within
--hang-after s: must be 0); silent (a stream that ended without [DONE] or an error: must be 0); KV blocks still
used on every engine once the load is over (must be 0).

    .venv/bin/python benchmarks/chaos.py [--faults kill,hang,drain,refuse] [--requests 60] [--rate 1]

--control-plane runs tests/k8s/test_control_plane_faults.py at full length instead (the operator killed 20 times
mid-reconcile, the API server stopped 60 s) on a private local cluster; run it under the machine's cluster lock.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from slofleet.bench.loadgen import MIX

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
BLOCKS = 256  # each engine's KV pool, in blocks
# Two engines on two cores: one torch thread each, two sequences at a time, so a queue forms under load.
ENGINE_FLAGS = ("--dtype", "float32", "--max-num-seqs", "2", "--num-blocks", str(BLOCKS), "--num-threads", "1",
                "--max-waiting-requests", "64", "--grace-period", "4", "--drain-delay", "0.5")
BUCKETS = {"buckets": [{"name": "chat", "priority": 0, "match": {"maxPromptTokens": 200},
                        "slo": {"ttftMs": 3000, "tpotMs": 400}},
                       {"name": "doc", "priority": 5, "slo": {"ttftMs": 8000}}]}
FAULTS = ("kill", "hang", "drain", "refuse", "kill-both-restart")
COLUMNS = ("sent", "ok", "retried", "failovers", "cut", "refused", "unserved", "lost", "hung", "silent",
           "kv_leaked")
HOLD_S = 30  # the router holds a request this long for a ready engine: an answer well before the client gives up


def pick_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 2.0) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None


def samples(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    r = get(url + "/metrics", 5.0)
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text if r is not None else ""):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@dataclass
class Proc:
    """A `slofleet` process on a fixed port, restartable there (a pod's container restarting on its pod IP)."""
    args: tuple[str, ...]
    log: Path
    port: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        cmd = [sys.executable, "-m", "slofleet.cli", *self.args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "a"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def ready(self, timeout: float = 300, path: str = "/ready") -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            r = get(self.url + path)
            if r is not None and r.status_code == 200:
                return self
            time.sleep(0.3)
        raise TimeoutError(f"{self.args[0]} on {self.port} not ready in {timeout} s")

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc and self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Fleet:
    engines: list[Proc]
    router: Proc

    @classmethod
    def up(cls, folder: Path, idle_timeout: float, port=pick_port) -> Fleet:
        engines = [Proc(("serve", *ENGINE_FLAGS), folder / f"engine{i}.log", port()).start() for i in range(2)]
        (folder / "buckets.json").write_text(json.dumps(BUCKETS))
        router = Proc(("router", *(f for e in engines for f in ("--upstream", e.url)), "--buckets",
                       str(folder / "buckets.json"), "--health-interval", "0.2", "--upstream-idle-timeout",
                       str(idle_timeout), "--hold-timeout-seconds", str(HOLD_S), "--log-level", "warning"),
                      folder / "router.log", port())
        fleet = cls(engines, router)
        try:
            for e in engines:
                e.ready()
            router.start().ready(60)
            fleet.wait_all_ready()
        except BaseException:
            fleet.down()
            raise
        return fleet

    def wait_all_ready(self, timeout: float = 300) -> None:
        """Every engine answering /ready, and the router seeing them all."""
        for e in self.engines:
            if e.proc.poll() is not None:
                e.start()
            e.ready(timeout)
        deadline = time.monotonic() + 30
        while samples(self.router.url).get("slofleet:router_replica_ready", 0) < len(self.engines):
            if time.monotonic() > deadline:
                raise TimeoutError("the router does not see every engine ready")
            time.sleep(0.2)

    def kv_used(self) -> int:
        """KV blocks in use over every engine (cached prefix blocks are free: evictable)."""
        return sum(round(samples(e.url).get("vllm:kv_cache_usage_perc", 0.0) * BLOCKS) for e in self.engines)

    def counters(self) -> tuple[float, float]:
        m = samples(self.router.url)
        return m.get("slofleet:router_retries_total", 0.0), m.get("slofleet:router_failovers_total", 0.0)

    def down(self) -> None:
        for p in (self.router, *self.engines):
            p.stop()


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLUMNS, 0))
    errors: list[str] = field(default_factory=list)

    def add(self, outcome: str, detail: str = "") -> None:
        self.counts[outcome] += 1
        if detail and outcome != "ok":
            self.errors.append(f"{outcome}: {detail}"[:300])


async def one(client: httpx.AsyncClient, url: str, body: dict, tally: Tally, hang_after: float) -> None:
    """One streaming request, told apart by what the client saw."""
    tally.counts["sent"] += 1
    seen = {"started": False}
    try:
        outcome, detail = await asyncio.wait_for(read(client, url, body, seen), hang_after)
    except asyncio.TimeoutError:
        outcome, detail = "hung", f"no terminal event in {hang_after:g} s"
    except httpx.TimeoutException as e:
        outcome, detail = "hung", repr(e)
    except httpx.HTTPError as e:
        outcome, detail = "cut" if seen["started"] else "lost", repr(e)
    tally.add(outcome, detail)


async def read(client: httpx.AsyncClient, url: str, body: dict, seen: dict) -> tuple[str, str]:
    done = False
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            # 503 after holding for a ready engine that never came: no engine was healthy, so not "lost"
            unserved = r.status_code == 503 and "came up within" in text
            return "refused" if r.status_code == 429 else "unserved" if unserved else "lost", f"{r.status_code} {text}"
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "cut" if seen["started"] else "lost", line
                delta = (chunk.get("choices") or [{}])[0].get("delta", {})
                seen["started"] = seen["started"] or bool(delta.get("content"))
    return ("ok", "") if done and seen["started"] else ("silent", "ended without [DONE] or an error")


def bodies(n: int, seed: int) -> list[dict]:
    """The mix, with outputs cut short so that a CPU run stays short: fresh prompts per seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        b = rng.choices(MIX, weights=[m.share for m in MIX])[0]
        body = b.body(MODEL, rng)
        out.append({**body, "max_tokens": min(b.max_tokens, 16)})
    return out


async def inject(fleet: Fleet, fault: str, at: float, hang_s: float) -> None:
    """The fault on engine 0 (and engine 1 for kill-both-restart) `at` s into the load; restarts as a pod would."""
    victim, other = fleet.engines
    await asyncio.sleep(at)
    if fault == "hang":
        victim.signal(signal.SIGSTOP)
        await asyncio.sleep(hang_s)
        victim.signal(signal.SIGCONT)
        return
    victim.signal(signal.SIGKILL if fault != "drain" else signal.SIGTERM)
    await asyncio.to_thread(victim.proc.wait)
    if fault == "kill-both-restart":
        victim.start()
        await asyncio.sleep(1.0)
        other.signal(signal.SIGKILL)
        await asyncio.to_thread(other.proc.wait)
        other.start()
        return
    victim.start()


async def run_fault(fleet: Fleet, fault: str, requests: int, rate: float, seed: int, hang_s: float,
                    hang_after: float) -> Tally:
    tally, rng = Tally(), random.Random(seed)
    retries0, failovers0 = fleet.counters()
    at = 0.0 if fault == "refuse" else requests / rate / 3
    async with httpx.AsyncClient(timeout=httpx.Timeout(hang_after, connect=10),
                                 limits=httpx.Limits(max_connections=500)) as client:
        chaos = asyncio.create_task(inject(fleet, fault, at, hang_s))
        if fault == "refuse":
            await asyncio.sleep(0.05)  # killed, not yet noticed by a probe
        tasks = []
        for body in bodies(requests, seed):
            tasks.append(asyncio.create_task(one(client, fleet.router.url, body, tally, hang_after)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        await chaos
    await asyncio.to_thread(fleet.wait_all_ready)
    retries1, failovers1 = fleet.counters()
    tally.counts["retried"], tally.counts["failovers"] = int(retries1 - retries0), int(failovers1 - failovers0)
    deadline = time.monotonic() + 20
    while (used := fleet.kv_used()) and time.monotonic() < deadline:  # a request aborted just now frees its blocks
        await asyncio.sleep(0.5)
    tally.counts["kv_leaked"] = used
    return tally


def table(results: dict[str, Tally]) -> str:
    lines = ["| fault | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for fault, t in results.items():
        lines.append(f"| {fault} | " + " | ".join(str(t.counts[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def run(faults: list[str], requests: int, rate: float, seed: int = 0, hang_s: float = 8.0, hang_after: float = 60.0,
        idle_timeout: float = 10.0, folder: Path | None = None, port=pick_port) -> dict[str, Tally]:
    folder = folder or Path(tempfile.mkdtemp(prefix="slofleet-chaos-"))
    fleet = Fleet.up(folder, idle_timeout, port)
    try:
        return {f: asyncio.run(run_fault(fleet, f, requests, rate, seed + i, hang_s, hang_after))
                for i, f in enumerate(faults)}
    finally:
        fleet.down()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--requests", type=int, default=60, help="requests per fault")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson): what one engine sustains")
    p.add_argument("--hang-seconds", type=float, default=8.0)
    p.add_argument("--hang-after", type=float, default=60.0, help="a request with no terminal event by then is hung")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--control-plane", action="store_true", help="the control plane faults, at full length")
    a = p.parse_args()
    if a.control_plane:
        env = {**os.environ, "SLOFLEET_CHAOS_REPEATS": "20", "SLOFLEET_CHAOS_OUTAGE": "60"}
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "tests/k8s/test_control_plane_faults.py"],
                              cwd=ROOT, env=env).returncode
    faults = [f for f in a.faults.split(",") if f]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        print(f"chaos: unknown fault(s) {', '.join(bad)}; choose from {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    results = run(faults, a.requests, a.rate, a.seed, a.hang_seconds, a.hang_after)
    print(table(results))
    for fault, t in results.items():
        for e in t.errors[:5]:
            print(f"  {fault}: {e}", file=sys.stderr)
    print(f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    bad = [f for f, t in results.items() if any(t.counts[c] for c in ("lost", "hung", "silent", "kv_leaked"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
