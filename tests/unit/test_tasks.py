"""stop_task ends background loops even when a cancellation is lost, and never hangs."""

from __future__ import annotations

import asyncio

from services.common.tasks import stop_task


async def test_a_loop_that_loses_a_cancel_is_still_stopped():
    cancels = 0

    async def loop_that_loses_the_first_cancel() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise
                # What asyncio.wait_for does on Python 3.11 when the awaited thing completes in
                # the same loop iteration as the cancel: the cancel is gone, the loop goes on.
                asyncio.current_task().uncancel()

    task = asyncio.create_task(loop_that_loses_the_first_cancel())
    await asyncio.sleep(0.1)
    assert await stop_task(task, timeout_s=5.0)
    assert task.cancelled() and cancels == 2


async def test_a_task_that_refuses_to_stop_is_given_up_after_the_bound():
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert not await stop_task(task, timeout_s=0.6)
    assert not task.done()
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=2)


async def test_finished_and_missing_tasks_are_stopped_already():
    async def quick() -> int:
        return 1

    task = asyncio.create_task(quick())
    await task
    assert await stop_task(task)
    assert await stop_task(None)
