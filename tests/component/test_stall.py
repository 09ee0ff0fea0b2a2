"""Stall detection: per-tier timeouts and the async iterator guard."""

import asyncio

import pytest
from pydantic import ValidationError

from services.common.errors import Unavailable
from services.router.resilience.stall import (
    StallConfig,
    StreamStalled,
    with_stall_timeout,
)

FAST = 0.05  # seconds; real time, kept tiny so the suite stays fast


class Source:
    """An async stream that yields `items`, pauses `pause_s` before item `pause_at`, records close."""

    def __init__(self, items, pause_at=None, pause_s=10.0, fail_at=None) -> None:
        self.items, self.pause_at, self.pause_s, self.fail_at = items, pause_at, pause_s, fail_at
        self.closed = False
        self.cancelled = False

    async def _gen(self):
        try:
            for i, item in enumerate(self.items):
                if i == self.pause_at:
                    await asyncio.sleep(self.pause_s)
                if i == self.fail_at:
                    raise ValueError("boom")
                yield item
        finally:
            self.closed = True

    def __aiter__(self):
        return self._gen()

    def cancel(self) -> bool:  # like grpc.aio.UnaryStreamCall
        self.cancelled = True
        return True


class TestPure:
    def test_tier_timeouts(self):
        config = StallConfig()
        assert [config.timeout_for(t) for t in "SAB"] == [2.0, 5.0, 15.0]
        with pytest.raises(ValueError):
            config.timeout_for("AUTO")

    @pytest.mark.parametrize("field", ["s_timeout_s", "a_timeout_s", "b_timeout_s"])
    def test_timeouts_must_be_positive(self, field):
        with pytest.raises(ValidationError):
            StallConfig(**{field: 0})


class TestWithStallTimeout:
    async def test_passes_items_through_and_closes(self):
        source = Source([1, 2, 3])
        assert [x async for x in with_stall_timeout(source, FAST)] == [1, 2, 3]
        assert source.closed and source.cancelled

    async def test_stall_raises_and_closes_the_source(self):
        source = Source([1, 2, 3], pause_at=2)
        seen = []
        with pytest.raises(StreamStalled) as info:
            async for x in with_stall_timeout(source, FAST):
                seen.append(x)
        assert seen == [1, 2]
        assert info.value.items == 2 and info.value.timeout_s == FAST
        assert isinstance(info.value, Unavailable)
        assert source.closed and source.cancelled

    async def test_first_item_gets_its_own_timeout(self):
        source = Source([1, 2], pause_at=0, pause_s=FAST * 2)
        assert [x async for x in with_stall_timeout(source, FAST, first_timeout_s=FAST * 20)] == [1, 2]
        with pytest.raises(StreamStalled):
            async for _ in with_stall_timeout(Source([1], pause_at=0), FAST * 20, first_timeout_s=FAST):
                pass

    async def test_slow_consumer_is_not_a_stall(self):
        out = []
        async for x in with_stall_timeout(Source([1, 2, 3]), FAST):
            await asyncio.sleep(FAST * 2)
            out.append(x)
        assert out == [1, 2, 3]

    async def test_source_errors_propagate(self):
        source = Source([1, 2], fail_at=1)
        with pytest.raises(ValueError):
            async for _ in with_stall_timeout(source, FAST):
                pass
        assert source.closed

    async def test_consumer_break_closes_the_source(self):
        source = Source([1, 2, 3])
        stream = with_stall_timeout(source, FAST)
        async for _ in stream:
            break
        await stream.aclose()
        assert source.closed and source.cancelled

    async def test_outside_cancellation_is_not_a_stall(self):
        source = Source([1], pause_at=0)

        async def consume():
            async for _ in with_stall_timeout(source, 5.0):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(FAST)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert source.closed and source.cancelled

    async def test_steady_items_slower_in_total_than_the_timeout(self):
        async def steady():
            for i in range(25):
                await asyncio.sleep(0.05)
                yield i

        # Each gap a twentieth of the timeout (a loaded machine delays a sleep, not by 0.95 s).
        assert [x async for x in with_stall_timeout(steady(), 1.0)] == list(range(25))

    async def test_stall_after_an_idle_consumer_is_measured_from_the_wait(self):
        source = Source([1, 2], pause_at=1)
        loop = asyncio.get_running_loop()
        stream = with_stall_timeout(source, 0.2)
        assert await anext(stream) == 1
        await asyncio.sleep(0.3)  # the consumer is busy past the timeout: not a stall
        started = loop.time()
        with pytest.raises(StreamStalled):
            await anext(stream)
        assert 0.15 <= loop.time() - started < 2.0
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0)  # no stray cancellation is left on the task

    async def test_source_swallowing_the_cancellation_still_stalls(self):
        async def stubborn():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass
            yield "late"

        with pytest.raises(StreamStalled):
            async for _ in with_stall_timeout(stubborn(), FAST):
                pass
        assert asyncio.current_task().cancelling() == 0

    async def test_source_swallowing_the_cancellation_then_ending_still_stalls(self):
        async def stubborn():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return
            yield "never"

        with pytest.raises(StreamStalled):
            async for _ in with_stall_timeout(stubborn(), FAST):
                pass
        assert asyncio.current_task().cancelling() == 0

    async def test_rejects_bad_timeouts(self):
        with pytest.raises(ValueError):
            async for _ in with_stall_timeout(Source([1]), 0):
                pass


async def test_shorter_limit_after_a_long_first_wait_fires_on_time():
    import time

    from services.router.resilience.stall import StreamStalled, with_stall_timeout

    async def source():
        for i in range(3):
            yield i
        await asyncio.sleep(5)
        yield 99

    started = time.monotonic()
    with pytest.raises(StreamStalled):
        async for _ in with_stall_timeout(source(), 0.2, first_timeout_s=3.0):
            pass
    assert time.monotonic() - started < 1.5
