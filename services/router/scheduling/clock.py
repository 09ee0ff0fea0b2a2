"""Time source of the scheduler: monotonic in production, hand-advanced in tests."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences are meaningful."""
        ...


class MonotonicClock:
    """The real clock: `time.monotonic`, never affected by wall-clock changes."""

    def now(self) -> float:
        return time.monotonic()


@dataclass
class FakeClock:
    """A clock that moves only when told to, so tests of timing never sleep."""

    current: float = 0.0

    def now(self) -> float:
        return self.current

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        self.current += seconds
        return self.current
