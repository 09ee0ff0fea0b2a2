"""A monotonic clock that moves only when told to, so timing tests never sleep."""

from __future__ import annotations


class FakeClock:
    """Called like `time.monotonic`; `advance` moves it forward."""

    def __init__(self, current: float = 0.0) -> None:
        self.current = current

    def __call__(self) -> float:
        return self.current

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        self.current += seconds
        return self.current
