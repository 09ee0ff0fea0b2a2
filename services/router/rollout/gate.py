"""The SLO gate of one candidate: error rate and p99 over a sliding window decide its fate.

Pure and clock-driven, so it is tested with a simulated clock. Each candidate request (a
canary attempt or a mirrored copy) is a sample: a failure, or a success with its time to
first token. A breach (error rate or p99 over the limit, once enough samples exist) rolls
the candidate back at once; a window as long as `window_s` that ran clean with at least
`min_requests` samples promotes it. Samples are bounded in number; the oldest go first.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass

from services.router.rollout.state import GatePolicy

MAX_SAMPLES = 100_000


class Verdict(str, enum.Enum):
    HOLD = "hold"
    PROMOTE = "promote"
    ROLLBACK = "rollback"


@dataclass(frozen=True)
class GateReading:
    """What the gate saw in its window, and what it concludes."""

    verdict: Verdict
    requests: int
    errors: int
    error_rate: float
    p99_ms: float | None
    reason: str


def p99(values: list[float]) -> float | None:
    """Nearest-rank 99th percentile; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class SloGate:
    def __init__(self, policy: GatePolicy, started_at: float, max_samples: int = MAX_SAMPLES) -> None:
        self.policy = policy
        self.started_at = started_at
        # (time, failed, latency_ms or None for failures)
        self._samples: deque[tuple[float, bool, float | None]] = deque(maxlen=max_samples)

    def record(self, now: float, ok: bool, latency_ms: float | None = None) -> None:
        self._samples.append((now, not ok, latency_ms if ok else None))

    def _trim(self, now: float) -> None:
        horizon = now - self.policy.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def reading(self, now: float) -> GateReading:
        self._trim(now)
        policy = self.policy
        count = len(self._samples)
        errors = sum(1 for _at, failed, _ms in self._samples if failed)
        rate = errors / count if count else 0.0
        latency = p99([ms for _at, failed, ms in self._samples if not failed and ms is not None])
        numbers = dict(requests=count, errors=errors, error_rate=rate, p99_ms=latency)
        if count >= policy.breach_min_requests:
            if rate > policy.max_error_rate:
                return GateReading(
                    Verdict.ROLLBACK,
                    **numbers,
                    reason=(
                        f"error rate {rate:.1%} over {policy.max_error_rate:.1%} ({errors} of {count} "
                        f"in {policy.window_s:g}s)"
                    ),
                )
            if latency is not None and latency > policy.max_p99_ms:
                return GateReading(
                    Verdict.ROLLBACK,
                    **numbers,
                    reason=(
                        f"p99 {latency:.0f}ms over {policy.max_p99_ms:.0f}ms ({count} requests in {policy.window_s:g}s)"
                    ),
                )
        if now - self.started_at >= policy.window_s and count >= policy.min_requests:
            shown = "-" if latency is None else f"{latency:.0f}ms"
            return GateReading(
                Verdict.PROMOTE,
                **numbers,
                reason=(f"clean window: {count} requests in {policy.window_s:g}s, error rate {rate:.1%}, p99 {shown}"),
            )
        return GateReading(Verdict.HOLD, **numbers, reason="collecting")
