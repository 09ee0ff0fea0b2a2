"""How long the engine goes without a step while requests wait on it.

A router that gets no token from a worker for its stall timeout counts the stream lost and
resumes it elsewhere; the worker alone can say why. Its event loop's lag
(services.common.loop_lag) says whether its front could not run; this watch says whether its
engine did not step. Every `interval_s` it reads the engine's step count (`Stepping`) and the
requests in flight: the time between two readings at which the count moved, while requests
were in flight, is one gap, exported as the histogram `ballast_worker_engine_step_gap` (ms;
as fine as `interval_s`, so a healthy engine's gaps read as about `interval_s`); the time
since the last step while requests are in flight now is the gauge
`ballast_worker_engine_stalled_ms` (0 when idle). A gap of `warn_s` or more is logged, at most
once a minute with the count since the last line.

The count is the engine's, not a request's: requests that all wait on something other than
the engine (a grammar compiling, KV arriving) read as a stall too, which is what a router
waiting on them sees.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from services.common.sampler import LoopSampler, WarningEvery
from services.common.telemetry import Telemetry
from services.worker.engine import Stepping

log = logging.getLogger(__name__)

# A warning for a long gap is logged at most once in this many seconds.
WARN_EVERY_S = 60.0


class StepGaps:
    """The gaps between engine steps seen by successive readings (pure bookkeeping: the
    readings and the clock are the caller's)."""

    def __init__(self, warn_s: float) -> None:
        self.warn_s = warn_s
        self._steps: int | None = None
        self._progress_at = 0.0  # when the count last moved, or the engine was last idle
        self._busy = False
        self._warnings = WarningEvery(WARN_EVERY_S)
        # The watch reads and writes, a metrics scrape (another thread) reads.
        self._lock = threading.Lock()

    def read(self, steps: int, in_flight: int, now: float) -> float | None:
        """One reading; returns the gap (s) that ended with it: the time since the count last
        moved, when it moved now with requests in flight, else None."""
        with self._lock:
            moved = self._steps is not None and steps != self._steps
            self._steps = steps
            was_busy, self._busy = self._busy, in_flight > 0
            if not was_busy:
                # Idle until now: no request waited, so the gap starts here.
                self._progress_at = now
                return None
            if not moved:
                return None
            gap, self._progress_at = now - self._progress_at, now
            return gap

    def stalled_s(self, now: float) -> float:
        """How long requests in flight have waited for a step now (0 when idle)."""
        with self._lock:
            return now - self._progress_at if self._busy else 0.0

    def warning(self, gap_s: float, now: float) -> str | None:
        """The line to log for a gap just ended, if one is due."""
        if gap_s < self.warn_s:
            return None
        count = self._warnings.occurred(now)
        if count is None:
            return None
        return (
            f"the engine computed no step for {gap_s:.1f} s while requests waited on it "
            f"({count} gap(s) of at least {self.warn_s:g} s since the last warning)"
        )


class EngineStallWatch(LoopSampler):
    """Reads the engine's steps every `interval_s` on the worker's loop and exports the gaps."""

    task_name = "engine-stall-watch"

    def __init__(
        self,
        engine: Stepping,
        in_flight: Callable[[], int],
        telemetry: Telemetry,
        interval_s: float,
        warn_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.gaps = StepGaps(warn_s)
        self.interval_s = interval_s
        self._engine = engine
        self._in_flight = in_flight
        self._clock = clock
        self._histogram = telemetry.latency_histogram(
            "ballast_worker_engine_step_gap",
            "Time between engine steps while requests were in flight, read every "
            f"{interval_s:g} s (a healthy engine reads about that).",
        )
        telemetry.meter.create_observable_gauge(
            "ballast_worker_engine_stalled_ms",
            callbacks=[self._observe_stalled],
            description="How long requests in flight have waited for an engine step now (0 when idle).",
        )

    async def _run(self) -> None:
        while True:
            now = self._clock()
            gap = self.gaps.read(self._engine.steps, self._in_flight(), now)
            if gap is not None:
                self._histogram.record(gap * 1000)
                warning = self.gaps.warning(gap, now)
                if warning is not None:
                    log.warning(warning)
            await asyncio.sleep(self.interval_s)

    def _observe_stalled(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self.gaps.stalled_s(self._clock()) * 1000)
