"""The router's scheduling front per model pool: a tier scheduler and its asyncio gate.

A gate hands out worker slots: only routable workers (healthy, not draining, breaker
closed, not hot) count, each with the capacity it advertises, so the router never sends a
worker more than it can take. Gates are pumped whenever the membership changes, so a new
or recovered worker takes queued work at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Mapping

from services.common.membership import MembershipWatcher
from services.router.resilience.health_view import WorkerHealthView
from services.router.scheduling.async_gate import AsyncGate
from services.router.scheduling.clock import MonotonicClock
from services.router.scheduling.scheduler import PoolScheduler, SchedulerObserver, WorkerSlots, slots_from_records
from services.router.scheduling.tiers import TierPolicy

log = logging.getLogger(__name__)


class PoolGates:
    def __init__(
        self,
        policy: TierPolicy,
        membership: MembershipWatcher,
        health: WorkerHealthView,
        observer: SchedulerObserver | None = None,
    ) -> None:
        self.policy = policy
        self.membership = membership
        self.health = health
        self.observer = observer
        self._gates: dict[str, AsyncGate] = {}
        self._task: asyncio.Task | None = None

    def _slots(self, model: str) -> Mapping[str, WorkerSlots]:
        workers = self.membership.workers()
        self.health.update(workers)
        routable = [w for w in self.health.routable(workers.values()) if w.model == model]
        return slots_from_records(routable)

    def has_capacity(self, model: str, excluding: frozenset[str] | set[str] = frozenset()) -> bool:
        """Whether any routable worker serves the model (busy or not), apart from `excluding`."""
        return any(worker_id not in excluding for worker_id in self._slots(model))

    def gate(self, model: str) -> AsyncGate:
        gate = self._gates.get(model)
        if gate is None:
            scheduler = PoolScheduler(self.policy, MonotonicClock(), pool=model, observer=self.observer)
            gate = self._gates[model] = AsyncGate(scheduler, lambda: self._slots(model))
        return gate

    def gates(self) -> dict[str, AsyncGate]:
        return dict(self._gates)

    def pump_all(self) -> None:
        for gate in self._gates.values():
            gate.pump()

    async def _pump_on_changes(self) -> None:
        version = self.membership.version
        while True:
            # The timeout also lets queued tickets past their wait limit be refused promptly.
            await self.membership.changed(version, timeout=0.5)
            version = self.membership.version
            self.pump_all()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._pump_on_changes(), name="pool-gates")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
