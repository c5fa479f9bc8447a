"""A time limit on part of a task, without asyncio.wait_for's extra task (Python 3.11's wraps the awaitable in one,
with a future and callbacks: twice per request on the router's hot path). asyncio.timeout does this from 3.11 on;
the project still runs on 3.10."""
from __future__ import annotations

import asyncio


class Deadline:
    """`async with Deadline(seconds):` cancels the current task when `seconds` pass inside the block and raises
    asyncio.TimeoutError in its place; a cancel from elsewhere stays a cancel."""

    def __init__(self, seconds: float):
        self.seconds, self.fired = seconds, False

    def fire(self) -> None:
        self.fired = True
        self.task.cancel()

    async def __aenter__(self) -> Deadline:
        self.task = asyncio.current_task()
        self.timer = asyncio.get_running_loop().call_later(self.seconds, self.fire)
        return self

    async def __aexit__(self, kind, exc, tb) -> bool:
        self.timer.cancel()
        if self.fired and kind is asyncio.CancelledError:
            # Python 3.11+ counts cancels: only ours pending means the time ran out, not a shutdown as well
            if not hasattr(self.task, "uncancel") or self.task.uncancel() == 0:
                raise asyncio.TimeoutError from exc
        return False
