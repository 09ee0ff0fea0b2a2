"""What the router's gauges show of its workers and queues, published from the event loop.

The Prometheus endpoint serves each scrape on a thread of its own, and OpenTelemetry calls
the observable gauges' callbacks there. The health view, the breakers and the schedulers
belong to the event loop: reading them from the scrape thread would race with routing (a
departed worker removed twice, a dict changing size under an iteration). So the loop
publishes an immutable view every `interval_s` and the callbacks only read the latest one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from services.common.membership import MembershipWatcher
from services.common.tasks import stop_task
from services.router.resilience.health_view import WorkerHealth, WorkerHealthView
from services.router.scheduling.scheduler import PoolSnapshot

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.25


@dataclass(frozen=True)
class RoutingView:
    """Each worker as the router routes by it, and each pool's queues, at one moment."""

    workers: Mapping[str, WorkerHealth] = field(default_factory=lambda: MappingProxyType({}))
    queues: Mapping[str, PoolSnapshot] = field(default_factory=lambda: MappingProxyType({}))

    def breakers(self) -> dict:
        """Breaker snapshots by worker id (workers without a breaker yet are left out)."""
        return {worker_id: h.breaker for worker_id, h in self.workers.items() if h.breaker is not None}


class RoutingViewPublisher:
    """Refreshes a RoutingView on the event loop; `current` is safe to read from any thread."""

    def __init__(
        self,
        membership: MembershipWatcher,
        health: WorkerHealthView,
        queues: Callable[[], Mapping[str, PoolSnapshot]],
        interval_s: float = PUBLISH_INTERVAL_S,
    ) -> None:
        self._membership = membership
        self._health = health
        self._queues = queues
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None
        self.current = RoutingView()

    def publish(self) -> RoutingView:
        """Takes a fresh view now (on the loop) and makes it the current one."""
        workers = self._membership.workers()
        self._health.update(workers)
        self.current = RoutingView(
            MappingProxyType(self._health.snapshot(workers)), MappingProxyType(dict(self._queues()))
        )
        return self.current

    async def start(self) -> None:
        self.publish()
        self._task = asyncio.create_task(self._run(), name="routing-view")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                self.publish()
                failing = False
            except Exception:
                # Logged once per run of failures, not four times a second: the gauges keep
                # the last view meanwhile.
                if not failing:
                    log.exception("could not refresh the routing view")
                failing = True
