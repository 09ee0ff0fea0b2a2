"""A bounded queue of pending session saves that keeps only the newest save per session.

A session's later save covers everything its earlier one would have written, so a second
save for a queued session replaces the first (superseded) instead of taking room; when the
queue is full a new session's save is dropped. Memory stays bounded and the loop never waits.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

T = TypeVar("T")


class SaveQueue(Generic[T]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._items: OrderedDict[Hashable, T] = OrderedDict()
        self._ready = asyncio.Event()
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, key: Hashable, item: T) -> str:
        """Queues `item`; returns "queued", "superseded" or "dropped". Never blocks."""
        if key in self._items:
            self._items[key] = item
            return "superseded"
        if len(self._items) >= self.capacity:
            return "dropped"
        self._items[key] = item
        self._idle.clear()
        self._ready.set()
        return "queued"

    async def take(self) -> T:
        """The oldest pending item; call `done()` once it is handled."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        _key, item = self._items.popitem(last=False)
        self._busy += 1
        return item

    def done(self) -> None:
        self._busy -= 1
        if self._busy == 0 and not self._items:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is queued or being handled, False if `timeout_s` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except asyncio.TimeoutError:
            return False
