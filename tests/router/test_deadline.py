"""slofleet.router.deadline: a block that runs past its time raises TimeoutError and leaves the task uncancelled;
one within its time is untouched; a cancel from elsewhere stays a cancel."""
from __future__ import annotations

import asyncio

import pytest

from slofleet.router.deadline import Deadline


def test_a_deadline_times_out_a_block_and_passes_other_cancels_on():
    async def main() -> None:
        task = asyncio.current_task()
        with pytest.raises(asyncio.TimeoutError):
            async with Deadline(0.05):
                await asyncio.sleep(5)
        await asyncio.sleep(0.01)  # no cancel left pending
        async with Deadline(5):
            await asyncio.sleep(0.01)
        asyncio.get_running_loop().call_later(0.02, task.cancel)
        with pytest.raises(asyncio.CancelledError):
            async with Deadline(5):
                await asyncio.sleep(5)

    asyncio.run(asyncio.wait_for(main(), 20))
