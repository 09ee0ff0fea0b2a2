"""Which workers may take a new request now: membership, temperature and breaker in one place.

A worker is routable when its record says healthy and not draining, its GPU is not hot
(with hysteresis), and its breaker lets a call through (closed, or half-open with a probe
slot free). The balancer filters its candidates through `routable` before scoring them;
the caller then takes a breaker permit for the worker it picked.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Mapping

from services.common.membership import WorkerRecord
from services.router.resilience.breaker import BreakerBoard, BreakerSnapshot, BreakerState, Permit
from services.router.resilience.temperature import TemperatureGate


class Unroutable(str, enum.Enum):
    """Why a worker takes no new request; the first that applies, in this order."""

    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
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

    def __init__(self, breakers: BreakerBoard, temperature: TemperatureGate) -> None:
        self.breakers = breakers
        self.temperature = temperature

    def update(self, workers: Mapping[str, WorkerRecord]) -> None:
        """Feeds the current membership: new temperatures in, departed workers out."""
        for record in workers.values():
            self.temperature.observe(record.id, record.temperature_c)
        ids = [record.id for record in workers.values()]
        self.temperature.retain(ids)
        self.breakers.retain(ids)

    def reason(self, worker: WorkerRecord) -> Unroutable | None:
        """Why `worker` may not take a new request now, or None when it may."""
        if not worker.healthy:
            return Unroutable.UNHEALTHY
        if worker.draining:
            return Unroutable.DRAINING
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
