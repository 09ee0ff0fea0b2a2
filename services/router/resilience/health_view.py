"""Which workers may take a new request now: membership, temperature and breaker in one place.

A worker is routable when its record says healthy and not draining, the router could reach
it at its last try, its GPU is not hot (with hysteresis), and its breaker lets a call through
(closed, or half-open with a probe slot free).

"Could reach it": a worker that dies keeps its etcd record until its lease expires (seconds).
A router that just failed to connect to it (or lost a stream to a reset) stops sending it
new work at once instead of letting every request in those seconds find out on its own. The
mark is per incarnation (id + lease): the same worker restarted, with a new lease, is
routable at once; and it lapses after `hold_s`, so a worker behind a passing network fault is
tried again. The pool gates offer the scheduler only workers that pass `routable`; the
caller then takes a breaker permit for the worker it was given.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from services.common.membership import WorkerRecord
from services.router.resilience.breaker import BreakerBoard, BreakerSnapshot, BreakerState, Permit
from services.router.resilience.temperature import TemperatureGate


class Unroutable(str, enum.Enum):
    """Why a worker takes no new request; the first that applies, in this order."""

    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    UNREACHABLE = "unreachable"
    HOT = "hot"
    BREAKER_OPEN = "breaker_open"
    PROBES_BUSY = "probes_busy"


@dataclass(frozen=True)
class WorkerHealth:
    """One worker as `ballast status` and the metrics show it."""

    worker_id: str
    routable: bool
    reason: Unroutable | None
    temperature_c: float | None
    hot: bool
    breaker: BreakerSnapshot | None

    def as_dict(self) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "routable": self.routable,
            "reason": None if self.reason is None else self.reason.value,
            "temperature_c": self.temperature_c,
            "hot": self.hot,
            "breaker": None if self.breaker is None else self.breaker.as_dict(),
        }


class WorkerHealthView:
    """Routability of workers, from their records plus the router's own breakers and gate."""

    def __init__(
        self,
        breakers: BreakerBoard,
        temperature: TemperatureGate,
        unreachable_hold_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.breakers = breakers
        self.temperature = temperature
        self.unreachable_hold_s = unreachable_hold_s
        self._clock = clock
        # worker id -> (lease of the incarnation that could not be reached, until when)
        self._unreachable: dict[str, tuple[int, float]] = {}

    def mark_unreachable(self, worker: WorkerRecord) -> None:
        """The router lost its connection to this incarnation of `worker`: no new work for it
        until it is replaced (a new lease), leaves membership, or `unreachable_hold_s` passes."""
        self._unreachable[worker.id] = (worker.lease_id, self._clock() + self.unreachable_hold_s)

    def mark_reachable(self, worker: WorkerRecord) -> None:
        self._unreachable.pop(worker.id, None)

    def _is_unreachable(self, worker: WorkerRecord) -> bool:
        mark = self._unreachable.get(worker.id)
        if mark is None:
            return False
        lease_id, until = mark
        if lease_id != worker.lease_id or self._clock() >= until:
            del self._unreachable[worker.id]
            return False
        return True

    def update(self, workers: Mapping[str, WorkerRecord]) -> None:
        """Feeds the current membership: new temperatures in, departed workers out."""
        for record in workers.values():
            self.temperature.observe(record.id, record.temperature_c)
        ids = [record.id for record in workers.values()]
        self.temperature.retain(ids)
        self.breakers.retain(ids)
        for worker_id in set(self._unreachable) - set(ids):
            del self._unreachable[worker_id]

    def settled(self) -> bool:
        """Whether nothing but the workers' records decides routability now and until the
        records change: every breaker closed and no worker marked unreachable. While this
        holds, a routable set computed from the same records is still right."""
        now = self._clock()
        for worker_id in [w for w, (_lease, until) in self._unreachable.items() if now >= until]:
            del self._unreachable[worker_id]  # lapsed (hold_s passed)
        return not self._unreachable and self.breakers.all_closed()

    def reason(self, worker: WorkerRecord) -> Unroutable | None:
        """Why `worker` may not take a new request now, or None when it may."""
        if not worker.healthy:
            return Unroutable.UNHEALTHY
        if worker.draining:
            return Unroutable.DRAINING
        if self._is_unreachable(worker):
            return Unroutable.UNREACHABLE
        if self.temperature.is_hot(worker.id):
            return Unroutable.HOT
        if not self.breakers.available(worker.id):
            if self.breakers.state(worker.id) is BreakerState.HALF_OPEN:
                return Unroutable.PROBES_BUSY
            return Unroutable.BREAKER_OPEN
        return None

    def is_routable(self, worker: WorkerRecord) -> bool:
        return self.reason(worker) is None

    def routable(self, workers: Iterable[WorkerRecord]) -> list[WorkerRecord]:
        return [w for w in workers if self.is_routable(w)]

    def acquire(self, worker_id: str) -> Permit | None:
        """A breaker permit for the chosen worker; None if it stopped being available."""
        return self.breakers.try_acquire(worker_id)

    def snapshot(self, workers: Mapping[str, WorkerRecord]) -> dict[str, WorkerHealth]:
        breakers = self.breakers.snapshot()
        health: dict[str, WorkerHealth] = {}
        for record in workers.values():
            reason = self.reason(record)
            health[record.id] = WorkerHealth(
                worker_id=record.id,
                routable=reason is None,
                reason=reason,
                temperature_c=record.temperature_c,
                hot=self.temperature.is_hot(record.id),
                breaker=breakers.get(record.id),
            )
        return health
