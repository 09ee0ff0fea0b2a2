"""Stall detection: a worker stream that goes silent for too long is treated as failed.

A dead worker is dropped by its etcd lease in a few seconds, but a stuck one (wedged GPU,
hung engine) keeps its lease and its connection while sending nothing. Each tier allows a
different silence between tokens (S 2 s, A 5 s, B 15 s by default). Past it the router
abandons the stream, counts a fault against the worker and resumes elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterable, AsyncIterator, TypeVar

from pydantic import Field

from services.common.config import Section
from services.common.errors import Unavailable
from services.common.tier import Tier

log = logging.getLogger(__name__)

T = TypeVar("T")


class StallConfig(Section):
    s_timeout_s: float = Field(2.0, gt=0, description="Longest silence between tokens of a tier-S stream.")
    a_timeout_s: float = Field(5.0, gt=0, description="Longest silence between tokens of a tier-A stream.")
    b_timeout_s: float = Field(15.0, gt=0, description="Longest silence between tokens of a tier-B stream.")

    def timeout_for(self, tier: Tier) -> float:
        """The stall timeout of tier S, A or B (ValueError for AUTO: it is never scheduled)."""
        timeouts = {Tier.S: self.s_timeout_s, Tier.A: self.a_timeout_s, Tier.B: self.b_timeout_s}
        try:
            return timeouts[tier]
        except KeyError:
            raise ValueError(
                f"unknown tier {str(tier)!r}; expected one of {sorted(t.value for t in timeouts)}"
            ) from None


class StreamStalled(Unavailable):
    """The next item of a stream did not arrive within the stall timeout."""

    def __init__(self, timeout_s: float, items: int) -> None:
        super().__init__(f"stream stalled: nothing for {timeout_s:g}s after {items} items")
        self.timeout_s = timeout_s
        self.items = items


class _Watchdog:
    """Cancels the consuming task when one wait on the source outlasts its limit.

    asyncio.timeout per item would create and cancel a timer for every token, on the
    router's hottest path. Here one timer per stream is re-armed lazily: a wait that ends in
    time only clears a field, and the timer, when it fires early, re-arms for the current
    wait's deadline.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        self._due: float | None = None  # deadline of the wait in progress; None between waits
        self._cancelling = 0
        self.fired = False

    def arm(self, limit_s: float) -> None:
        self._task = asyncio.current_task()
        if self._task is None:
            raise RuntimeError("with_stall_timeout must be iterated inside an asyncio task")
        self._cancelling = self._task.cancelling()
        self._due = self._loop.time() + limit_s
        # Re-arming is lazy only for later deadlines; an earlier one (the first token may get a
        # longer limit than the rest) needs the timer moved forward.
        if self._handle is None or self._handle.when() > self._due:
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self._loop.call_at(self._due, self._check)

    def disarm(self) -> None:
        self._due = None

    def _check(self) -> None:
        self._handle = None
        if self._due is None or self._task is None:
            return  # between waits: the next arm() starts a timer again
        if self._loop.time() < self._due:
            self._handle = self._loop.call_at(self._due, self._check)
            return
        self.fired = True
        self._task.cancel()

    def stalled(self) -> bool:
        """Consumes the watchdog's cancellation; True when no other cancellation is pending.

        Same rule as asyncio.timeout: a cancellation from outside (client gone) wins.
        """
        if not self.fired or self._task is None:
            return False
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def _close_source(source: object, iterator: AsyncIterator[object]) -> None:
    try:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
    except Exception as exc:  # the stream is being abandoned; its own cleanup error is moot
        log.debug("error while closing a stalled stream: %s", exc)
    # A grpc.aio call is iterated through a generator whose close leaves the RPC open;
    # cancelling the call is what stops the work on the worker.
    cancel = getattr(source, "cancel", None)
    if callable(cancel):
        cancel()


async def with_stall_timeout(
    source: AsyncIterable[T], timeout_s: float, *, first_timeout_s: float | None = None
) -> AsyncIterator[T]:
    """Yields `source`'s items; raises StreamStalled when one takes longer than `timeout_s`.

    `first_timeout_s` (default `timeout_s`) bounds the wait for the first item, which
    includes queueing and prefill. Only the wait on the source counts, never the time the
    consumer spends between items. The source is closed (and cancelled, when it has a
    `cancel()` like a grpc.aio call) however iteration ends.
    """
    if timeout_s <= 0 or (first_timeout_s is not None and first_timeout_s <= 0):
        raise ValueError("stall timeouts must be > 0")
    iterator = aiter(source)
    watchdog = _Watchdog()
    items = 0
    try:
        while True:
            limit = first_timeout_s if items == 0 and first_timeout_s is not None else timeout_s
            watchdog.arm(limit)
            ended = False
            try:
                item = await anext(iterator)
            except StopAsyncIteration:
                ended = True
            except asyncio.CancelledError:
                if watchdog.stalled():
                    raise StreamStalled(limit, items) from None
                raise
            finally:
                watchdog.disarm()
            if watchdog.fired:
                # The source swallowed the watchdog's cancellation and went on late.
                if watchdog.stalled():
                    raise StreamStalled(limit, items)
                raise asyncio.CancelledError()
            if ended:
                return
            items += 1
            yield item
    finally:
        watchdog.close()
        await _close_source(source, iterator)
