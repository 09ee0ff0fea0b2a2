"""Per-worker circuit breakers: isolate a worker whose calls fail, probe it back in later.

A breaker is CLOSED while a worker's fault rate over a sliding window stays at or under
the limit. Above it (and only once the window holds enough requests to mean something) it
OPENS: the worker gets no traffic for a cool-down. Then it turns HALF_OPEN and lets a few
probe requests through; if they all succeed it CLOSES, and one probe fault reopens it with
a longer cool-down (exponential, capped).

Only worker faults count. `outcome` maps a call's gRPC status to SUCCESS, FAULT or IGNORE:
client errors and client cancellations say nothing about the worker, and overload
(RESOURCE_EXHAUSTED) is backpressure the balancer already reacts to.

Single-threaded by design (one asyncio loop per process), so no locks.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Callable, Iterable

import grpc
from pydantic import Field, model_validator

from services.common.config import Section
from services.common.errors import Fault
from services.common.faults import classify

Clock = Callable[[], float]
"""Returns monotonic seconds; injectable so tests run on simulated time."""

# Windows are kept in buckets; this bounds the buckets a config may ask for.
MAX_BUCKETS = 3600


class BreakerConfig(Section):
    error_rate: float = Field(
        0.05, gt=0, lt=1, description="Fault share of a worker's calls in the window above which its breaker opens."
    )
    window_s: float = Field(30.0, gt=0, description="Sliding window over which the fault share is measured.")
    bucket_s: float = Field(1.0, gt=0, description="Granularity of the sliding window.")
    min_requests: int = Field(
        20, ge=1, description="Calls the window must hold before its fault share can open the breaker."
    )
    cooldown_s: float = Field(5.0, gt=0, description="First time an open breaker keeps a worker out.")
    max_cooldown_s: float = Field(120.0, gt=0, description="Longest cool-down after repeated failed probes.")
    cooldown_multiplier: float = Field(2.0, ge=1, description="Cool-down growth each time a probe fails.")
    half_open_probes: int = Field(
        3, ge=1, description="Probe calls let through when half-open; all must succeed to close."
    )

    @model_validator(mode="after")
    def _consistent(self) -> "BreakerConfig":
        if self.bucket_s > self.window_s:
            raise ValueError("bucket_s must not exceed window_s")
        if self.window_s / self.bucket_s > MAX_BUCKETS:
            raise ValueError(f"window_s / bucket_s must be at most {MAX_BUCKETS}")
        if self.max_cooldown_s < self.cooldown_s:
            raise ValueError("max_cooldown_s must be >= cooldown_s")
        return self


class SlidingCounts:
    """A few counters summed over the last `window_s`, in fixed buckets so memory stays bounded."""

    def __init__(self, window_s: float, bucket_s: float, width: int) -> None:
        self._bucket_s = bucket_s
        self._span = max(1, math.ceil(window_s / bucket_s))
        self._width = width
        self._ring: deque[tuple[int, list[int]]] = deque()

    def _expire(self, now: float) -> int:
        current = math.floor(now / self._bucket_s)
        if self._ring and current < self._ring[-1][0]:
            # A clock that steps back must not create out-of-order buckets.
            current = self._ring[-1][0]
        oldest = current - self._span + 1
        while self._ring and self._ring[0][0] < oldest:
            self._ring.popleft()
        return current

    def add(self, now: float, index: int, amount: int = 1) -> None:
        current = self._expire(now)
        if not self._ring or self._ring[-1][0] != current:
            self._ring.append((current, [0] * self._width))
        self._ring[-1][1][index] += amount

    def totals(self, now: float) -> tuple[int, ...]:
        self._expire(now)
        return tuple(sum(counts[i] for _, counts in self._ring) for i in range(self._width))

    def clear(self) -> None:
        self._ring.clear()


class Outcome(str, enum.Enum):
    SUCCESS = "success"
    FAULT = "fault"
    IGNORE = "ignore"


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# The caller sent something wrong, or may not do it: any worker would answer the same.
CLIENT_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
NOT_WORKER_FAULTS = frozenset(
    {
        # Backpressure: the worker is full, not broken; admission and the balancer handle it.
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        # The router cancels worker calls itself (client gone, preemption, stall abort);
        # a stall is recorded as a fault explicitly where it is detected.
        grpc.StatusCode.CANCELLED,
        # A worker call's deadline is the client's: its expiry measures the client's budget,
        # not the worker. A worker that goes silent is caught by the stall timeout instead.
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


def outcome(code: grpc.StatusCode | None, *, client_cancelled: bool = False) -> Outcome:
    """What a finished worker call's status code says about the worker. `None` means no error."""
    if client_cancelled:
        # Whatever status the call ended with, it ended because the client left.
        return Outcome.IGNORE
    if code is None or code == grpc.StatusCode.OK:
        return Outcome.SUCCESS
    if code in CLIENT_ERRORS or code in NOT_WORKER_FAULTS:
        return Outcome.IGNORE
    return Outcome.FAULT


def outcome_of(error: BaseException | None, *, client_cancelled: bool = False) -> Outcome:
    """`outcome` for whatever ended a call: a gRPC error, a Ballast error, or anything else."""
    if error is None:
        return outcome(None, client_cancelled=client_cancelled)
    failure = classify(error)
    if failure is None:
        # Task cancellation (client gone), generator close, or a bug in the router itself:
        # none of them is evidence against the worker.
        return Outcome.IGNORE
    # A Ballast error covers StreamStalled and "stream ended without finishing" (both UNAVAILABLE).
    return outcome(failure.code, client_cancelled=client_cancelled)


@dataclass(frozen=True)
class BreakerSnapshot:
    """One worker's breaker, for metrics and `ballast status`."""

    worker_id: str
    state: BreakerState
    requests: int
    faults: int
    error_rate: float
    opens: int
    cooldown_s: float
    half_open_in_s: float | None
    probes_in_flight: int
    probe_successes: int

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["state"] = self.state.value
        return data


TransitionListener = Callable[[str, BreakerState, BreakerState], None]


class Permit:
    """Leave to send one call to a worker. Its outcome must be recorded once.

    Used as a context manager, the permit records on exit what ended the block (SUCCESS
    when nothing did), unless `record` was called inside it.
    """

    __slots__ = ("breaker", "epoch", "probe", "_recorded")

    def __init__(self, breaker: "CircuitBreaker", epoch: int, probe: bool) -> None:
        self.breaker = breaker
        self.epoch = epoch
        self.probe = probe
        self._recorded = False

    @property
    def recorded(self) -> bool:
        return self._recorded

    def record(self, outcome: Outcome) -> None:
        """Records the call's outcome; later calls are ignored."""
        if self._recorded:
            return
        self._recorded = True
        self.breaker._record(self, outcome)

    def release(self) -> None:
        """Frees the permit without judging the worker (for `finally` blocks)."""
        self.record(Outcome.IGNORE)

    def __enter__(self) -> "Permit":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.record(outcome_of(exc))


class CircuitBreaker:
    """The breaker of one worker. See the module docstring for the state machine."""

    def __init__(
        self,
        worker_id: str,
        config: BreakerConfig,
        clock: Clock = time.monotonic,
        on_transition: TransitionListener | None = None,
    ) -> None:
        self.worker_id = worker_id
        self._config = config
        self._clock = clock
        self._on_transition = on_transition
        self._window = SlidingCounts(config.window_s, config.bucket_s, width=2)  # successes, faults
        self._state = BreakerState.CLOSED
        # Bumped on every transition, so outcomes of calls admitted under an earlier state
        # (long streams still running when the breaker opened) do not steer the new one.
        self._epoch = 0
        self._opened_at = 0.0
        self._closed_at: float | None = None
        self._cooldown_s = config.cooldown_s
        self._opens = 0
        self._probes_in_flight = 0
        self._probe_successes = 0

    # --- state machine ----------------------------------------------------------

    def _advance(self, now: float) -> None:
        if self._state is BreakerState.OPEN and now >= self._opened_at + self._cooldown_s:
            self._transition(BreakerState.HALF_OPEN, now)

    def _transition(self, new: BreakerState, now: float) -> None:
        old, self._state = self._state, new
        self._epoch += 1
        self._probes_in_flight = 0
        self._probe_successes = 0
        if new is BreakerState.OPEN:
            self._opened_at = now
            self._opens += 1
            self._window.clear()
        elif new is BreakerState.CLOSED:
            self._closed_at = now
            self._window.clear()
        if self._on_transition is not None:
            self._on_transition(self.worker_id, old, new)

    def _open(self, now: float, probe_failed: bool) -> None:
        flapping = self._closed_at is not None and now - self._closed_at < self._config.window_s
        if probe_failed or flapping:
            # Still broken, or broke again right after coming back: wait longer each time.
            self._cooldown_s = min(self._config.max_cooldown_s, self._cooldown_s * self._config.cooldown_multiplier)
        else:
            self._cooldown_s = self._config.cooldown_s
        self._transition(BreakerState.OPEN, now)

    def _record(self, permit: Permit, outcome: Outcome) -> None:
        now = self._clock()
        self._advance(now)
        if permit.epoch != self._epoch:
            return
        if self._state is BreakerState.CLOSED:
            if outcome is Outcome.SUCCESS:
                self._window.add(now, 0)
            elif outcome is Outcome.FAULT:
                self._window.add(now, 1)
                successes, faults = self._window.totals(now)
                total = successes + faults
                if total >= self._config.min_requests and faults / total > self._config.error_rate:
                    self._open(now, probe_failed=False)
        elif self._state is BreakerState.HALF_OPEN and permit.probe:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)
            if outcome is Outcome.FAULT:
                self._open(now, probe_failed=True)
            elif outcome is Outcome.SUCCESS:
                self._probe_successes += 1
                if self._probe_successes >= self._config.half_open_probes:
                    self._transition(BreakerState.CLOSED, now)
            # IGNORE only frees the probe slot for another probe.

    # --- public API ---------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        self._advance(self._clock())
        return self._state

    def available(self) -> bool:
        """Whether a call may go to this worker now; changes nothing but the clock's effect."""
        self._advance(self._clock())
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.HALF_OPEN:
            return self._probes_in_flight + self._probe_successes < self._config.half_open_probes
        return False

    def try_acquire(self) -> Permit | None:
        """A permit for one call, or None while the worker is isolated or its probes are out."""
        if not self.available():
            return None
        probe = self._state is BreakerState.HALF_OPEN
        if probe:
            self._probes_in_flight += 1
        return Permit(self, self._epoch, probe)

    def snapshot(self) -> BreakerSnapshot:
        now = self._clock()
        self._advance(now)
        successes, faults = self._window.totals(now)
        total = successes + faults
        half_open_in = None
        if self._state is BreakerState.OPEN:
            half_open_in = max(0.0, self._opened_at + self._cooldown_s - now)
        return BreakerSnapshot(
            worker_id=self.worker_id,
            state=self._state,
            requests=total,
            faults=faults,
            error_rate=faults / total if total else 0.0,
            opens=self._opens,
            cooldown_s=self._cooldown_s,
            half_open_in_s=half_open_in,
            probes_in_flight=self._probes_in_flight,
            probe_successes=self._probe_successes,
        )


class BreakerBoard:
    """The breakers of every known worker, created on first use, dropped with the worker."""

    def __init__(
        self,
        config: BreakerConfig,
        clock: Clock = time.monotonic,
        on_transition: TransitionListener | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._on_transition = on_transition
        self._breakers: dict[str, CircuitBreaker] = {}
        # Workers whose breaker is open or half-open. Kept from the transitions themselves, so
        # "every breaker closed" (the router's usual state) is known without asking each one.
        self._not_closed: set[str] = set()

    def get(self, worker_id: str) -> CircuitBreaker:
        breaker = self._breakers.get(worker_id)
        if breaker is None:
            breaker = CircuitBreaker(worker_id, self.config, self._clock, self._transitioned)
            self._breakers[worker_id] = breaker
        return breaker

    def _transitioned(self, worker_id: str, old: BreakerState, new: BreakerState) -> None:
        if new is BreakerState.CLOSED:
            self._not_closed.discard(worker_id)
        else:
            self._not_closed.add(worker_id)
        if self._on_transition is not None:
            self._on_transition(worker_id, old, new)

    def all_closed(self) -> bool:
        """Whether every breaker is closed: then none keeps any worker out, now or as time passes."""
        for worker_id in list(self._not_closed):
            breaker = self._breakers.get(worker_id)
            # A mark left by a forgotten worker's breaker (its late permits may still record)
            # keeps nothing out.
            if breaker is None or breaker.state is BreakerState.CLOSED:
                self._not_closed.discard(worker_id)
        return not self._not_closed

    def available(self, worker_id: str) -> bool:
        breaker = self._breakers.get(worker_id)
        return breaker is None or breaker.available()

    def try_acquire(self, worker_id: str) -> Permit | None:
        return self.get(worker_id).try_acquire()

    def state(self, worker_id: str) -> BreakerState:
        breaker = self._breakers.get(worker_id)
        return BreakerState.CLOSED if breaker is None else breaker.state

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Forgets workers that left the membership, so the board stays as small as the pool.

        Permits still held for a forgotten worker can be recorded harmlessly.
        """
        keep = set(worker_ids)
        for worker_id in [w for w in self._breakers if w not in keep]:
            del self._breakers[worker_id]
            self._not_closed.discard(worker_id)

    def snapshot(self) -> dict[str, BreakerSnapshot]:
        return {worker_id: breaker.snapshot() for worker_id, breaker in self._breakers.items()}

    def __len__(self) -> int:
        return len(self._breakers)


def is_connection_lost(error: BaseException) -> bool:
    """True when a call to a worker failed because the router could not reach it (as opposed
    to the worker answering with an error, such as "draining" or "full")."""
    failure = classify(error)
    return failure is not None and failure.fault is Fault.UNREACHABLE
