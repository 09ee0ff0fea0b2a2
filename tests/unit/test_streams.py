"""The coalescer merges what a slow consumer has not taken, and propagates errors and close."""

import asyncio

import pytest

from services.common.streams import Coalescer


async def numbers(n, delay=0.0, fail_at=None, closed=None):
    try:
        for i in range(n):
            if fail_at == i:
                raise ValueError("boom")
            yield [i]
            await asyncio.sleep(delay)
    finally:
        if closed is not None:
            closed.set()


def merge(a, b):
    return a + b


async def test_fast_consumer_gets_every_item_in_order():
    out = [batch async for batch in Coalescer(numbers(5, delay=0.01), merge)]
    assert sum(out, []) == [0, 1, 2, 3, 4]


async def test_slow_consumer_gets_merged_batches():
    stream = Coalescer(numbers(50), merge)
    batches = []
    async for batch in stream:
        batches.append(batch)
        await asyncio.sleep(0.01)
    assert sum(batches, []) == list(range(50))
    assert len(batches) < 50


async def test_merge_refusal_keeps_items_apart():
    stream = Coalescer(numbers(4), lambda a, b: None)
    out = [batch async for batch in stream]
    assert out == [[0], [1], [2], [3]]


async def test_error_reaches_consumer_after_items():
    seen = []
    with pytest.raises(ValueError, match="boom"):
        async for batch in Coalescer(numbers(5, fail_at=3), merge):
            seen.extend(batch)
    assert seen == [0, 1, 2]


async def test_aclose_stops_the_source():
    closed = asyncio.Event()
    stream = Coalescer(numbers(1000, delay=0.01, closed=closed), merge)
    async for _ in stream:
        break
    await stream.aclose()
    await asyncio.wait_for(closed.wait(), 1)
