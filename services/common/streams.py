"""Stream helpers: merge items a slow consumer has not taken yet, so memory stays bounded.

The producer runs ahead in its own task and appends into a single slot; the consumer takes
everything accumulated since its last read as one merged item. A lagging client therefore
gets fewer, larger messages instead of an ever-growing queue, and generation never waits on
the network.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Generic, TypeVar

T = TypeVar("T")

# The longest a stream may hold tokens back to send them together (GenerateRequest.flush_interval_ms).
MAX_FLUSH_INTERVAL_MS = 10_000


class _Done:
    pass


_DONE = _Done()


class Coalescer(Generic[T]):
    """Runs `source` in a task; iterating yields merged batches of what it produced."""

    def __init__(self, source: AsyncIterator[T], merge: Callable[[T, T], T | None]) -> None:
        # `merge(a, b)` returns the merged item, or None when a and b must stay separate
        # (e.g. b closes the stream); the consumer then gets a first and b next.
        self._source = source
        self._merge = merge
        self._pending: list[T] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._ended = asyncio.Event()  # the source is done (or failed, or was failed)
        self._task: asyncio.Task | None = None

    def _put(self, item: T) -> None:
        if self._pending:
            merged = self._merge(self._pending[-1], item)
            if merged is not None:
                self._pending[-1] = merged
                self._ready.set()
                return
        self._pending.append(item)
        self._ready.set()

    async def _pump(self) -> None:
        try:
            async for item in self._source:
                self._put(item)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, who decides
            self._error = exc
        finally:
            self._ended.set()
            self._ready.set()

    def __aiter__(self) -> "Coalescer[T]":
        if self._task is None:
            self._task = asyncio.create_task(self._pump())
        return self

    async def __anext__(self) -> T:
        while not self._pending:
            if self._ended.is_set():
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        return self._pending.pop(0)

    def fail(self, error: BaseException) -> None:
        """Ends the stream from outside: the consumer gets what is pending, then `error`."""
        if self._ended.is_set():
            return
        if self._task is not None:
            self._task.cancel()
        self._error = error
        self._ended.set()
        self._ready.set()

    async def settle(self, seconds: float) -> None:
        """Lets items accumulate for up to `seconds` (they merge), returning early once the
        source has ended: holding tokens back to send fewer messages never delays the end."""
        if self._ended.is_set() or seconds <= 0:
            return
        try:
            # Not asyncio.wait_for, which can swallow a cancellation as the event fires.
            async with asyncio.timeout(seconds):
                await self._ended.wait()
        except TimeoutError:
            pass

    async def aclose(self) -> None:
        """Stops the producer (closing its source, which aborts upstream work)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        aclose = getattr(self._source, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except (RuntimeError, Exception):
                pass
