"""The router's own added latency: time to first byte through the router minus direct, at N concurrent streams.

The upstream is a STAND-IN, not the engine: a raw HTTP/1.1 server (run in its own process) that answers every
generation request with an SSE stream of `--events` events, the first at once and the others
`--gap` seconds apart, so that N streams really are open together. With no model behind it, what remains
of the TTFB is HTTP and the router itself.

    .venv/bin/python benchmarks/router_overhead.py --concurrency 100
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).parent))
from router_prefix import free_port, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class StandIn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the stand-in: a GET answers 200 at once; a POST
    (its body read whole) answers an SSE stream, chunked, its first event at once and the rest `gap` s apart. A raw
    protocol rather than an ASGI app under uvicorn: it costs about a quarter of the CPU per stream, which on shared
    cores is CPU the client and the router keep."""
    CHUNK = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
    events, gap = 10, 0.05

    def connection_made(self, transport) -> None:
        self.transport, self.buf, self.timer = transport, b"", None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0 or self.timer is not None:
            return
        head = self.buf[:head_end].lower()
        length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]) if b"content-length:" in head else 0
        if len(self.buf) < head_end + 4 + length:
            return
        self.buf = self.buf[head_end + 4 + length:]
        if head.startswith(b"get "):  # /ready, /health: "ok"; /metrics: no samples (the router keeps its own count)
            body = b"" if head.startswith(b"get /metrics") else b"ok"
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            return
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
                             b"\r\n\r\n")
        self.send(self.events)

    @staticmethod
    def chunk(body: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(body), body)

    def send(self, left: int) -> None:
        """The next event now and the rest `gap` s apart; after the last, the end of the stream."""
        if left:
            self.transport.write(self.chunk(self.CHUNK))
            self.timer = asyncio.get_running_loop().call_later(self.gap, self.send, left - 1)
            return
        self.transport.write(self.chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        self.timer = None
        if self.buf:  # a request that came while this one streamed
            self.data_received(b"")

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()


def standin(port: int, events: int, gap: float) -> None:
    StandIn.events, StandIn.gap = events, gap

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(StandIn, "127.0.0.1", port, backlog=4096)
        await server.serve_forever()

    uvloop.run(serve())


async def ttfbs(url: str, concurrency: int, seconds: float, stream_s: float) -> tuple[list[float], int]:
    """`concurrency` streams kept open for `seconds`: each worker starts a new stream when its last one ends
    (starts staggered over one stream's length, so arrivals are steady, not one burst). Each stream's time to
    its first body byte, but for each worker's first stream, which also pays for opening the connections; and the
    streams that failed (an error status, a connection error, or an answer without the stand-in's end)."""
    body = json.dumps({"model": "m", "prompt": "hello " * 50, "max_tokens": 8, "stream": True}).encode()
    out: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker(offset: float, deadline: float) -> None:
            nonlocal errors
            await asyncio.sleep(offset)
            opening = True
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/v1/completions", data=body,
                                      headers={"content-type": "application/json"}) as r:
                        last = await r.content.readany()
                        ttfb = time.perf_counter() - t0
                        async for chunk in r.content.iter_any():
                            last = chunk
                    if r.status != 200 or not last.endswith(b"data: [DONE]\n\n"):
                        raise ValueError(f"status {r.status}, ending {last[-60:]!r}")
                    if not opening:
                        out.append(ttfb)
                except (aiohttp.ClientError, ValueError):
                    errors += 1
                opening = False
        end = time.perf_counter() + seconds
        await asyncio.gather(*(worker(stream_s * i / concurrency, end) for i in range(concurrency)))
    return out, errors


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children (the router's workers), from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") + sum(cpu_s(int(k)) for k in kids)


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] * 1000 if len(xs) > 1 else xs[0] * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=100)
    p.add_argument("--seconds", type=float, default=8.0, help="measuring time per path and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds, alternating direct and router")
    p.add_argument("--events", type=int, default=10)
    p.add_argument("--gap", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=1, help="the router's --workers")
    p.add_argument("--standin", type=int, help=argparse.SUPPRESS)  # internal: run the stand-in on this port
    args = p.parse_args()
    if args.standin:
        standin(args.standin, args.events, args.gap)
        return 0
    up_port, router_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--standin", str(up_port), "--events", str(args.events),
                               "--gap", str(args.gap)], env=env),
             subprocess.Popen([sys.executable, "-m", "slofleet.cli", "router", "--port", str(router_port),
                               "--upstream", f"http://127.0.0.1:{up_port}", "--log-level", "warning",
                               "--capacity-per-replica", str(4 * args.concurrency), "--workers", str(args.workers)],
                              cwd=ROOT, env=env)]
    try:
        direct_url, router_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{router_port}"
        asyncio.run(wait_ready(direct_url, 30))
        asyncio.run(wait_ready(router_url, 30))
        paths: dict[str, list[float]] = {"direct": [], "router": []}
        # CPU seconds of the client (this process), the stand-in and the router while each path was measured: on
        # shared cores the router path's streams/s is bounded by what the three together cost per stream
        cpu = {name: [0.0, 0.0, 0.0] for name in paths}
        errors = dict.fromkeys(paths, 0)
        for _ in range(args.rounds):
            for name, url in (("direct", direct_url), ("router", router_url)):
                before = (time.process_time(), cpu_s(procs[0].pid), cpu_s(procs[1].pid))
                xs, failed = uvloop.run(ttfbs(url, args.concurrency, args.seconds, args.events * args.gap))
                paths[name] += xs
                errors[name] += failed
                after = (time.process_time(), cpu_s(procs[0].pid), cpu_s(procs[1].pid))
                cpu[name] = [c + b - a for c, a, b in zip(cpu[name], before, after)]
        direct, routed = paths["direct"], paths["router"]
        print(f"stand-in upstream (no model), {args.concurrency} concurrent streams, router --workers {args.workers}, "
              f"{len(direct)} / {len(routed)} "
              f"streams measured direct / through the router, "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        print(f"{'path':<8} {'streams/s':>10} {'TTFB P50 ms':>12} {'P90 ms':>8} {'P99 ms':>8}")
        span = args.rounds * args.seconds
        for name, xs in (("direct", direct), ("router", routed)):
            print(f"{name:<8} {len(xs) / span:>10.0f} {pct(xs, 50):>12.2f} {pct(xs, 90):>8.2f} {pct(xs, 99):>8.2f}")
        print(f"failed streams: {errors['direct']} direct, {errors['router']} through the router (target 0)")
        print(f"router / direct: {len(routed) / len(direct):.2f}x the streams (target at 1,000 streams: >= 0.9x), "
              f"P99 TTFB {pct(routed, 99) / pct(direct, 99):.2f}x (target at 1,000: <= 2x)")
        print(f"router overhead, P50 through router minus P50 direct: {pct(routed, 50) - pct(direct, 50):.2f} ms "
              f"(target at 100 streams: < 2 ms)")
        for name, xs in paths.items():  # every stream run, the unmeasured first ones and failed ones too
            n = len(xs) + errors[name] + args.rounds * args.concurrency
            client, up, router = (c / n * 1e6 for c in cpu[name])
            print(f"CPU per stream, {name}: client {client:.0f} us, stand-in {up:.0f} us, router {router:.0f} us")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
