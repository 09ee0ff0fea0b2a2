"""How late a service's event loop runs what is due: the service's own view of being starved.

Everything a Ballast service does for a request runs on one asyncio loop. When that loop is
held (a long callback, a thread holding the GIL, the cores given to other processes), every
stream it carries waits, and nothing else in the service says so: a router that gets no token
for seconds cannot tell an engine that did not step from a worker front that could not send.

A timer set for every `interval_s` measures how late it fires. Each lateness is exported as
the histogram `ballast_event_loop_lag` (ms) and the worst of the last `window_s` as the gauge
`ballast_event_loop_lag_worst_ms` (an alert's input); a lag at or over `warn_ms` is logged,
at most once per window with the count of such lags since the last line, so a starved process
says so in its log without flooding it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from services.common.sampler import LoopSampler, WarningEvery

log = logging.getLogger(__name__)


class LagWindow:
    """The lags measured, the worst of the last `window_s`, and when to warn (pure
    bookkeeping: the clock is the caller's)."""

    def __init__(self, window_s: float, warn_ms: float) -> None:
        self.window_s = window_s
        self.warn_ms = warn_ms
        # (time, lag ms), lags decreasing from the left: the worst in the window is first.
        self._worst: deque[tuple[float, float]] = deque()
        self._warnings = WarningEvery(window_s)
        # The loop records, a metrics scrape (another thread) reads.
        self._lock = threading.Lock()

    def record(self, lag_ms: float, now: float) -> str | None:
        """Adds one lag measured at `now`; returns the warning to log, if one is due."""
        with self._lock:
            while self._worst and self._worst[-1][1] <= lag_ms:
                self._worst.pop()
            self._worst.append((now, lag_ms))
            self._drop_old(now)
        if lag_ms < self.warn_ms:
            return None
        count = self._warnings.occurred(now)
        if count is None:
            return None
        return (
            f"event loop ran {lag_ms / 1000:.1f} s late, and every stream this process carries waited "
            f"({count} lag(s) of at least {self.warn_ms / 1000:g} s since the last warning)"
        )

    def worst_ms(self, now: float) -> float:
        """The worst lag of the last `window_s` (0 when none was measured in it)."""
        with self._lock:
            self._drop_old(now)
            return self._worst[0][1] if self._worst else 0.0

    def _drop_old(self, now: float) -> None:
        while self._worst and now - self._worst[0][0] > self.window_s:
            self._worst.popleft()


class LoopLagMonitor(LoopSampler):
    """Measures the running loop's lag every `interval_s` and exports it on `meter`."""

    task_name = "event-loop-lag"

    def __init__(
        self,
        meter,
        histogram,
        interval_s: float,
        window_s: float,
        warn_ms: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.window = LagWindow(window_s, warn_ms)
        self._histogram = histogram
        self._clock = clock
        meter.create_observable_gauge(
            "ballast_event_loop_lag_worst_ms",
            callbacks=[self._observe_worst],
            description=f"The longest the event loop ran a due timer late in the last {window_s:g} s (ms).",
        )

    async def _run(self) -> None:
        while True:
            due = self._clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = self._clock()
            self.record(max(0.0, (now - due) * 1000), now)

    def record(self, lag_ms: float, now: float) -> None:
        """One lag measured at `now`: into the histogram and the window, logged when due."""
        self._histogram.record(lag_ms)
        warning = self.window.record(lag_ms, now)
        if warning is not None:
            log.warning(warning)

    def _observe_worst(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self.window.worst_ms(self._clock()))
