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


async def test_settle_merges_what_comes_meanwhile_and_returns_when_the_source_ends():
    stream = Coalescer(numbers(6, delay=0.01), merge)
    first = await stream.__aiter__().__anext__()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await stream.settle(30.0)  # the source ends after ~50 ms: no waiting out the 30 s
    assert loop.time() - started < 10.0
    rest = [batch async for batch in stream]
    assert first == [0] and rest == [[1, 2, 3, 4, 5]]


async def test_settle_waits_its_time_while_the_source_goes_on():
    stream = Coalescer(numbers(1000, delay=0.01), merge)
    iterator = stream.__aiter__()
    assert await iterator.__anext__() == [0]
    await stream.settle(0.1)
    # Ten-odd items arrived meanwhile and come as one message; the source is still running.
    assert len(await iterator.__anext__()) > 1
    await stream.aclose()
