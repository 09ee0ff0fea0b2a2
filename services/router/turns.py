"""Agent turn outcomes, a business health signal: did the user's turn get a usable answer?

A turn succeeds when it finished without a timeout or a format error (structured output that
could not be validated or repaired is a format error). Degraded answers count as successes:
the fallback count tracks those apart. Cancellations and refused bad input are the client's
doing and do not count either way. Exported as the counter `ballast_agent_turns{outcome}` (the
rate is derivable from it over any range) and the gauge `ballast_agent_turn_success_rate`, the
rate over a sliding window, for dashboards and alerts that want one number.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from typing import Callable, Iterable

import grpc
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from services.common.errors import BallastError

DEFAULT_WINDOW_S = 300.0
DEFAULT_BUCKETS = 30
CLIENT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


class TurnOutcome(str, enum.Enum):
    SUCCESS = "success"
    TIMEOUT = "timeout"
    FORMAT_ERROR = "format_error"
    REFUSED = "refused"  # overload: the user got no answer
    ERROR = "error"
    CANCELLED = "cancelled"  # the client went away: not counted in the rate
    REJECTED = "rejected"  # bad input, unknown model, bad key: not counted in the rate

    @property
    def counts_in_rate(self) -> bool:
        return self not in (TurnOutcome.CANCELLED, TurnOutcome.REJECTED)


def classify_turn(
    error: BaseException | None, finished: bool, structured_failed: bool, deadline_passed: bool
) -> TurnOutcome:
    """The outcome of one Generate call, from how it ended."""
    if error is None:
        if not finished:
            return TurnOutcome.ERROR
        return TurnOutcome.FORMAT_ERROR if structured_failed else TurnOutcome.SUCCESS
    if isinstance(error, BallastError):
        code = error.code
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TurnOutcome.TIMEOUT
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return TurnOutcome.REFUSED
        if code in CLIENT_CODES:
            return TurnOutcome.REJECTED
        return TurnOutcome.ERROR
    if isinstance(error, asyncio.CancelledError):
        # grpc cancels the handler when the client's deadline passes, too.
        return TurnOutcome.TIMEOUT if deadline_passed else TurnOutcome.CANCELLED
    return TurnOutcome.ERROR


class SlidingWindowRate:
    """Share of successes among the outcomes of the last `window_s` seconds, in fixed buckets.

    Memory is bounded by the bucket count, whatever the traffic; the window slides by one
    bucket at a time.
    """

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        buckets: int = DEFAULT_BUCKETS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or buckets < 1:
            raise ValueError("window_s must be > 0 and buckets >= 1")
        self.window_s = window_s
        self._width = window_s / buckets
        self._clock = clock
        # slot -> [bucket number, successes, total]
        self._buckets = [[-1, 0, 0] for _ in range(buckets)]
        self._lock = threading.Lock()

    def _bucket(self, now: float) -> list[int]:
        number = int(now // self._width)
        bucket = self._buckets[number % len(self._buckets)]
        if bucket[0] != number:
            bucket[:] = [number, 0, 0]
        return bucket

    def record(self, success: bool) -> None:
        with self._lock:
            bucket = self._bucket(self._clock())
            bucket[1] += int(success)
            bucket[2] += 1

    def rate(self) -> float | None:
        """The success share in the window; None when no turn ended in it."""
        with self._lock:
            newest = int(self._clock() // self._width)
            live = [b for b in self._buckets if newest - len(self._buckets) < b[0] <= newest]
            total = sum(b[2] for b in live)
            return sum(b[1] for b in live) / total if total else None


class TurnMetrics:
    def __init__(self, meter: Meter, window: SlidingWindowRate | None = None) -> None:
        self.window = window or SlidingWindowRate()
        self.turns = meter.create_counter(
            "ballast_agent_turns",
            description="Finished Generate calls (agent turns) by outcome: success, timeout, format_error, "
            "refused, error (these five make the success rate), cancelled, rejected.",
        )
        meter.create_observable_gauge(
            "ballast_agent_turn_success_rate",
            callbacks=[self._observe],
            description=f"Share of agent turns that succeeded over the last {self.window.window_s:.0f} s.",
        )

    def record(self, outcome: TurnOutcome, model: str = "") -> None:
        """`model` only once it is known to be served: a client's typo must not become a label."""
        self.turns.add(1, {"outcome": outcome.value, "model": model})
        if outcome.counts_in_rate:
            self.window.record(outcome is TurnOutcome.SUCCESS)

    def _observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        rate = self.window.rate()
        if rate is not None:
            yield Observation(rate)
