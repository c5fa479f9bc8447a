"""A request's tries (the replicas tried, the answer if all fail), and failover's two bounds: how many retries may
be out at once, and how long one try may wait for a first byte.

Retry budget (as Envoy's): retries in flight stay under a share of the requests in flight, or a floor, so that a
fleet-wide fault does not multiply the load on the replicas still up. A request that needs a retry while the
budget is spent waits for room (up to its time-to-first-byte budget) instead of failing: a request that had not
started is never lost to the budget, only delayed.

Per-try timeout: a try that has no first byte within the bucket's TTFT target (at least `min_try_timeout`, at most
`try_timeout`) is abandoned for another replica, when there is one to try and the budget has room; the last try
waits out the request's whole time-to-first-byte budget. Each try's limit is below the request's, so a hung
replica costs a retry, not the client's own timeout. A busy replica abandoned this way has its request aborted
(its connection closed), so the work is not done twice."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from slofleet.tracing.core import LeanSpan

from .buckets import Bucket
from .http1 import Response
from .replicas import Replica


@dataclass(slots=True, kw_only=True)
class Failed:
    """The answer for the client when no try opened: an error status and its JSON body."""
    status: int
    body: bytes


@dataclass(slots=True, kw_only=True)
class Pick:
    replica: Replica
    prefill: Replica | None  # the prefill replica named in the hand-off header, for a long prompt


@dataclass(slots=True, kw_only=True)
class Tries:
    """One request's tries so far."""
    bucket: str
    long_prompt: bool  # long enough to prefill on a prefill replica
    hold_until: float  # monotonic s: the most to wait for a first ready replica
    tried: set[str] = field(default_factory=set)
    bad_prefill: set[str] = field(default_factory=set)
    last: Failed | None = None  # the answer if every try fails
    deadline: float | None = None  # monotonic s: the time-to-first-byte budget, from the first try
    first_try: int | None = None  # ns
    first_url: str | None = None  # the replica tried first: an answer from another is a failover
    spent: bool = False  # the budget ran out: no further try
    retrying: bool = False  # holds a slot of the retry budget
    try_limit: float = 0.0  # s: one try's wait for a first byte while another try is possible
    down: bool = False  # the last try's replica refused or dropped the connection


@dataclass(slots=True, kw_only=True)
class RetryBudget:
    percent: float = 20.0  # retries in flight, as a share of requests in flight
    floor: int = 3  # retries in flight always allowed, however few requests are
    active: int = 0  # requests opening or streaming through this router
    retrying: int = 0  # requests on a retry try now
    freed: asyncio.Event = field(default_factory=asyncio.Event)  # replaced each time a retry ends

    def room(self) -> bool:
        return self.retrying < max(self.floor, self.percent / 100 * self.active)

    async def acquire(self, until: float) -> bool:
        """Take a retry slot, waiting for one until `until` (monotonic s); False when none came."""
        while not self.room():
            left = until - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.freed.wait(), left)
            except asyncio.TimeoutError:
                return False
        self.retrying += 1
        return True

    def release(self) -> None:
        self.retrying -= 1
        self.freed.set()
        self.freed = asyncio.Event()


def try_limit(bucket: Bucket, min_try: float, max_try: float) -> float:
    """One try's time to first byte before another replica is tried: the bucket's TTFT target, within bounds."""
    slo = getattr(bucket, "slo", None)
    target = slo.ttft_ms / 1000 if slo is not None and slo.ttft_ms else max_try
    return min(max_try, max(min_try, target))


def early_error(first: bytes) -> Failed | None:
    """The answer for the client when the first chunk read (nothing of it sent yet: a chat stream's role event may
    come before) holds a server error event, as from an engine that cut a queued request as it shut down: retried
    elsewhere first. None for any other first chunk."""
    at = (b"\n\n" + first).find(b'\n\ndata: {"error"')  # an event's start, in the chunk as it came
    if at < 0:
        return None
    try:
        error = json.loads(first[at + 6:].split(b"\n\n", 1)[0])["error"]
        status = int(error.get("code") or 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not 500 <= status < 600:
        return None
    return Failed(status=status, body=json.dumps({"error": error}).encode())


@dataclass(slots=True, kw_only=True)
class Opened:
    """A replica that started answering: its response, read up to the first chunk."""
    replica: Replica
    resp: Response
    first: bytes
    span: LeanSpan  # the answering try's
    waited: float  # s from sending the try to its first chunk


@dataclass(slots=True, kw_only=True)
class Cut:
    """Why a started answer ended early: the metric's reason, and the SSE error event's status, message and type."""
    reason: str
    status: int
    message: str
    kind: str
