"""Engine progress on a Relay stream: a router's requests wait on a busy engine, not a wedged one.

A router gives a request a bounded wait for its first token. Past it the request moves on, and
when the worker relayed no token to that router meanwhile, the router suspects the request of
having wedged the worker (poison containment counts the loss against it). An engine that spends
those seconds on a long prefill, or on a burst of other requests' prefills (a worker that took
over a lost worker's streams, a hot GPU at half speed), relays nothing and is not wedged.

So while a router has requests on the stream, once per interval in which the engine computed
steps but none of that router's requests got a token, the worker sends the engine's step count
(`RelayEvents.engine`). A hung engine's count stops and a stopped process sends nothing: both
still read as silent, and so does an engine whose last report came early in the router's wait
(`router.quarantine.engine_quiet_s`). While tokens flow the router knows the worker is alive
from them, and nothing more is sent: the report costs nothing on a streaming worker.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

from services.worker.engine import Stepping

if TYPE_CHECKING:
    from services.worker.relay import Outbox


class ProgressReporter:
    """Reports `engine`'s steps into `outbox` (one Relay stream's) at each `tick` that finds
    the engine moved, no token posted since the last tick, and `busy()` (requests on the
    stream)."""

    def __init__(self, engine: Stepping, outbox: "Outbox", busy: Callable[[], bool]) -> None:
        self._engine = engine
        self._outbox = outbox
        self._busy = busy
        self._steps = engine.steps
        self._tokens = outbox.tokens_posted

    def tick(self) -> bool:
        """One interval's end: True when it reported."""
        steps, tokens = self._engine.steps, self._outbox.tokens_posted
        report = steps != self._steps and tokens == self._tokens and self._busy()
        if report:
            self._outbox.post_progress(steps)
        self._steps, self._tokens = steps, tokens
        return report

    async def run(self, interval_s: float) -> None:
        """Ticks every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.tick()
