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
from services.common.membership import WorkerRecord
from services.router.scheduling.scheduler import PoolScheduler, SchedulerObserver, WorkerSlots
from services.router.scheduling.tiers import TierPolicy

log = logging.getLogger(__name__)


def slot_key(worker: WorkerRecord) -> str:
    """A worker incarnation: its id plus its lease. A request that failed on a worker avoids
    that incarnation only, so the same worker restarted (a new lease) can take it again."""
    return f"{worker.id}@{worker.lease_id:x}"


def worker_id_of(key: str) -> str:
    return key.partition("@")[0]


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
        return {slot_key(w): WorkerSlots(w.capacity, w.in_flight) for w in routable}

    def has_capacity(self, model: str, excluding: frozenset[str] | set[str] = frozenset()) -> bool:
        """Whether any routable worker serves the model (busy or not), apart from the slot
        keys in `excluding`."""
        return any(key not in excluding for key in self._slots(model))

    def key_for(self, worker_id: str | None) -> str | None:
        """The slot key of a worker's current incarnation (for affinity), if it is a member."""
        worker = self.membership.get(worker_id) if worker_id else None
        return slot_key(worker) if worker is not None else None

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
