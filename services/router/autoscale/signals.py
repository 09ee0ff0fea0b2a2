"""Bounded sliding windows the autoscaler reads its signals from: latency percentiles, the
queue-wait trend, and the request rate against its own recent baseline.

Every window is bounded in time and in memory whatever the load. Time is whatever the caller
passes as `now` (seconds); a sample older than the newest one seen is taken as arriving now,
so a late report can never reorder a window.
"""

from __future__ import annotations

import math
from collections import deque


class LatencyWindow:
    """Latency samples of the last `window_s` seconds, at most `max_samples` of them (the
    newest win: under heavy load the percentile covers a shorter, still recent, span)."""

    def __init__(self, window_s: float, max_samples: int) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._last = -math.inf
        self.overflowed = 0
        """Samples pushed out by max_samples before they aged out."""

    def add(self, now: float, value: float) -> None:
        self._last = max(self._last, now)
        if len(self._samples) == self._samples.maxlen:
            self._expire(self._last)
            if len(self._samples) == self._samples.maxlen:
                self.overflowed += 1
        self._samples.append((self._last, value))

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] <= horizon:
            self._samples.popleft()

    def count(self, now: float) -> int:
        self._expire(now)
        return len(self._samples)

    def values(self, now: float) -> list[float]:
        """The samples still in the window (for a summary another process can merge)."""
        self._expire(now)
        return [value for _, value in self._samples]

    def percentile(self, now: float, quantile: float, min_samples: int = 1) -> float | None:
        """Nearest-rank percentile (0 < quantile <= 1); None with fewer than `min_samples`."""
        self._expire(now)
        if len(self._samples) < max(1, min_samples):
            return None
        values = sorted(value for _, value in self._samples)
        rank = max(1, math.ceil(quantile * len(values)))
        return values[rank - 1]


class TrendWindow:
    """Samples of one quantity (queue wait) over the last `window_s` seconds and their
    least-squares line: is it rising, and where is it now."""

    def __init__(self, window_s: float, max_samples: int) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._last = -math.inf

    def add(self, now: float, value: float) -> None:
        self._last = max(self._last, now)
        self._samples.append((self._last, value))

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] <= horizon:
            self._samples.popleft()

    def fit(self, now: float, min_samples: int) -> tuple[float, float] | None:
        """(slope per second, fitted value at `now`), or None with too few samples or no spread
        in time (all samples at one instant say nothing about a trend)."""
        self._expire(now)
        n = len(self._samples)
        if n < max(2, min_samples):
            return None
        # Centre the times so the sums stay well conditioned with epoch-sized timestamps.
        mean_t = sum(t for t, _ in self._samples) / n
        mean_v = sum(v for _, v in self._samples) / n
        var_t = sum((t - mean_t) ** 2 for t, _ in self._samples)
        if var_t <= 1e-12:
            return None
        slope = sum((t - mean_t) * (v - mean_v) for t, v in self._samples) / var_t
        return slope, mean_v + slope * (now - mean_t)


class RateTracker:
    """Arrivals counted in fixed buckets of `bucket_s` seconds, kept for `horizon_buckets`.

    Rates use completed buckets only, so a half-filled current bucket never reads as a dip;
    the cost is up to one bucket of detection lag.
    """

    def __init__(self, bucket_s: float, horizon_buckets: int) -> None:
        self.bucket_s = bucket_s
        self._buckets: deque[list[int]] = deque(maxlen=horizon_buckets + 1)  # [index, count]
        self._first_index: int | None = None

    def _index(self, now: float) -> int:
        return math.floor(now / self.bucket_s)

    def add(self, now: float, count: int = 1) -> None:
        index = self._index(now)
        if self._first_index is None:
            self._first_index = index
        if self._buckets and index <= self._buckets[-1][0]:
            self._buckets[-1][1] += count  # late or same-bucket report: counts as the newest
        else:
            self._buckets.append([index, count])

    def mark(self, now: float) -> None:
        """Starts the history at `now` without an arrival: an idle pool has a baseline of zero."""
        if self._first_index is None:
            self._first_index = self._index(now)

    def _sum(self, first: int, last: int) -> int:
        return sum(count for index, count in self._buckets if first <= index <= last)

    def rate(self, now: float, buckets: int) -> float:
        """Arrivals per second over the `buckets` completed buckets before the current one."""
        current = self._index(now)
        return self._sum(current - buckets, current - 1) / (buckets * self.bucket_s)

    def baseline(self, now: float, skip_buckets: int, buckets: int, min_s: float) -> float | None:
        """Arrivals per second over the `buckets` buckets before the `skip_buckets` most recent
        completed ones; None until at least `min_s` seconds of such history exist."""
        if self._first_index is None:
            return None
        last = self._index(now) - 1 - skip_buckets
        first = max(last - buckets + 1, self._first_index)
        covered = (last - first + 1) * self.bucket_s
        if covered < min_s or covered <= 0:
            return None
        return self._sum(first, last) / covered
