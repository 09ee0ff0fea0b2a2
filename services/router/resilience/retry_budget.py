"""Retry budget: retries and resumes may add only a bounded share on top of real traffic.

Every client request deposits into a sliding window; every retry or resume withdraws. A
retry is allowed while retries in the window stay within `ratio` of the requests, plus a
small per-second allowance so a quiet router can still fail over. Each request is also
capped at `max_attempts` attempts. When either limit is reached the caller fails fast with
UNAVAILABLE instead of piling more load onto a pool that is already failing.
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass

from pydantic import Field, model_validator

from services.common.config import Section
from services.router.resilience.breaker import MAX_BUCKETS, Clock, SlidingCounts

REQUESTS, RETRIES = 0, 1


class RetryBudgetConfig(Section):
    ratio: float = Field(0.2, ge=0, description="Retries allowed as a share of requests in the window.")
    window_s: float = Field(10.0, gt=0, description="Sliding window of the budget.")
    bucket_s: float = Field(1.0, gt=0, description="Granularity of the sliding window.")
    min_retries_per_s: float = Field(
        3.0,
        ge=0,
        description="Retries allowed per second of window whatever the traffic: one worker lost takes all its streams at once.",
    )
    max_attempts: int = Field(5, ge=1, description="Attempts per request at most, the first one included.")

    @model_validator(mode="after")
    def _consistent(self) -> "RetryBudgetConfig":
        if self.bucket_s > self.window_s:
            raise ValueError("bucket_s must not exceed window_s")
        if self.window_s / self.bucket_s > MAX_BUCKETS:
            raise ValueError(f"window_s / bucket_s must be at most {MAX_BUCKETS}")
        return self


class Refusal(str, enum.Enum):
    MAX_ATTEMPTS = "max_attempts"
    BUDGET = "budget"


@dataclass(frozen=True)
class RetryBudgetSnapshot:
    requests: int
    retries: int
    allowance: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class RetryBudget:
    """One router's budget, shared by all its requests (single asyncio loop: no locks)."""

    def __init__(self, config: RetryBudgetConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._window = SlidingCounts(config.window_s, config.bucket_s, width=2)

    def _allowance(self, requests: int) -> float:
        return self.config.ratio * requests + self.config.min_retries_per_s * self.config.window_s

    def record_request(self) -> None:
        """Counts one client request (once, however many attempts it takes)."""
        self._window.add(self._clock(), REQUESTS)

    def try_acquire(self) -> bool:
        """Takes one retry from the budget; False (taking nothing) when it is spent."""
        now = self._clock()
        requests, retries = self._window.totals(now)
        if retries + 1 > self._allowance(requests):
            return False
        self._window.add(now, RETRIES)
        return True

    def start(self) -> "RequestAttempts":
        """Records a new request and returns its attempt counter."""
        self.record_request()
        return RequestAttempts(self)

    def snapshot(self) -> RetryBudgetSnapshot:
        requests, retries = self._window.totals(self._clock())
        return RetryBudgetSnapshot(requests=requests, retries=retries, allowance=self._allowance(requests))


class RequestAttempts:
    """Attempts of one request: the first is free, each further one needs the budget."""

    def __init__(self, budget: RetryBudget) -> None:
        self._budget = budget
        self.attempts = 1
        self.refusal: Refusal | None = None

    def try_again(self) -> bool:
        """Whether another attempt (retry or resume) may start; `refusal` says why not."""
        if self.attempts >= self._budget.config.max_attempts:
            self.refusal = Refusal.MAX_ATTEMPTS
            return False
        if not self._budget.try_acquire():
            self.refusal = Refusal.BUDGET
            return False
        self.attempts += 1
        self.refusal = None
        return True

    def ask(self) -> Refusal | None:
        """`try_again` as the failover decision asks it: None when granted, else why not."""
        return None if self.try_again() else self.refusal
