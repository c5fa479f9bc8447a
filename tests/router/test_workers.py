"""`slofleet router --workers 2`: two worker processes share the port (SO_REUSEPORT), serve concurrent streams
between them, and a SIGTERM to the parent drains and ends both."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tests.support.router import RouterProc

from .helpers import StandIn


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_two_workers_share_the_port_and_stop_together(tmp_path):
    up = StandIn()
    router = RouterProc("--upstream", up.url, "--workers", "2", log=tmp_path / "router.log")
    try:
        router.wait_ready()
        workers = children(router.proc.pid)
        assert len(workers) == 2

        async def one(i: int) -> int:
            async with httpx.AsyncClient() as c:  # a connection of its own: the kernel picks its worker
                r = await c.post(router.url + "/v1/completions", json={"model": "m", "prompt": f"hi {i}",
                                                                        "max_tokens": 2, "stream": True}, timeout=30)
                return r.status_code

        async def load() -> list[int]:
            return await asyncio.gather(*(one(i) for i in range(60)))

        assert asyncio.run(load()) == [200] * 60
        # each worker counts what it served: over fresh connections, /metrics answers from both
        served = set()
        for _ in range(40):
            text = httpx.get(router.url + "/metrics", headers={"connection": "close"}, timeout=5).text
            served.add(sum(float(line.split()[-1]) for line in text.splitlines()
                           if line.startswith("slofleet:router_requests_total")))
        assert all(served) and (sum(served) == 60 or served == {30.0}), served  # both served some of the 60
        router.stop()
        assert router.proc.returncode == 0
        assert not any(Path(f"/proc/{w}").exists() and "zombie" not in Path(f"/proc/{w}/status").read_text()
                       for w in workers)
    finally:
        router.stop()
        up.stop()
