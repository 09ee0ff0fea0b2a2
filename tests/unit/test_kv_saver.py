"""The bounded save queue: newest save per session, drops when full, never blocks."""

import asyncio

from services.worker.kv.saver import SaveQueue


async def test_supersedes_then_drops_then_drains():
    queue: SaveQueue[str] = SaveQueue(2)
    assert queue.offer("s1", "a1") == "queued"
    assert queue.offer("s1", "a2") == "superseded"
    assert queue.offer("s2", "b1") == "queued"
    assert queue.offer("s3", "c1") == "dropped"
    assert len(queue) == 2
    assert not await queue.wait_idle(0.01)
    assert await queue.take() == "a2"
    assert await queue.take() == "b1"
    assert not await queue.wait_idle(0.01)  # taken but not done
    queue.done()
    queue.done()
    assert await queue.wait_idle(0.01)


async def test_take_waits_for_an_item():
    queue: SaveQueue[int] = SaveQueue(1)
    waiter = asyncio.create_task(queue.take())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    queue.offer("k", 7)
    assert await asyncio.wait_for(waiter, 1) == 7
