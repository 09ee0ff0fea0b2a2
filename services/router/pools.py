"""The router's scheduling front per model pool: a tier scheduler and its asyncio gate.

A gate hands out worker slots: only routable workers (healthy, not draining, breaker
closed, not hot) count, each with the capacity it advertises, so the router never sends a
worker more than it can take. Gates are pumped whenever the membership changes, so a new
or recovered worker takes queued work at once. During a rollout each version of a model
gets its own gate (`model@version`), so a request never lands on the other version's workers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Mapping

from services.common.membership import MembershipWatcher
from services.common.membership import WorkerRecord
from services.common.tasks import stop_task
from services.router.resilience.health_view import Unroutable, WorkerHealthView
from services.router.scheduling.async_gate import AsyncGate
from services.router.scheduling.scheduler import PoolScheduler, SchedulerObserver, WorkerSlots
from services.router.scheduling.tiers import TierPolicy

log = logging.getLogger(__name__)

# Reasons a worker is out that come from its own failures (not heat, draining or health).
BREAKER_REASONS = (Unroutable.BREAKER_OPEN, Unroutable.PROBES_BUSY)


def slot_key(worker: WorkerRecord) -> str:
    """A worker incarnation: its id plus its lease. A request that failed on a worker avoids
    that incarnation only, so the same worker restarted (a new lease) can take it again."""
    return f"{worker.id}@{worker.lease_id:x}"


def worker_id_of(key: str) -> str:
    return key.partition("@")[0]


def pool_name(model: str, version: str | None) -> str:
    """A gate's name: the model, or `model@version` for a gate limited to one version."""
    return model if version is None else f"{model}@{version}"


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
        # (model, version) -> slots, computed from membership version `_slots_membership` while
        # the health view was settled. Every request asks for its pool's slots several times
        # (admission, dispatch, release); without this each ask walks every worker.
        self._settled_slots: dict[tuple[str, str | None], Mapping[str, WorkerSlots]] = {}
        self._slots_membership = -1

    def _routable(self, model: str, version: str | None) -> list[WorkerRecord]:
        workers = self.membership.workers()
        self.health.update(workers)
        return [
            w
            for w in self.health.routable(workers.values())
            if w.model == model and (version is None or w.model_version == version)
        ]

    def _slots(self, model: str, version: str | None = None) -> Mapping[str, WorkerSlots]:
        """Routable workers' slots, by slot key. The mapping returned may be shared: read only."""
        if self._slots_membership != self.membership.version:
            self._settled_slots.clear()
            self._slots_membership = self.membership.version
        settled = self.health.settled()
        if settled and (cached := self._settled_slots.get((model, version))) is not None:
            return cached
        slots = {slot_key(w): WorkerSlots(w.capacity, w.in_flight) for w in self._routable(model, version)}
        if settled:
            self._settled_slots[(model, version)] = slots
        return slots

    def has_capacity(
        self, model: str, excluding: frozenset[str] | set[str] = frozenset(), version: str | None = None
    ) -> bool:
        """Whether any routable worker serves the model (of `version`, when given; busy or
        not), apart from the slot keys in `excluding`."""
        return any(key not in excluding for key in self._slots(model, version))

    def isolated(self, model: str, version: str) -> bool:
        """Whether the version has workers and the breakers keep every one of them out."""
        members = [w for w in self.membership.workers().values() if w.model == model and w.model_version == version]
        return bool(members) and all(self.health.reason(w) in BREAKER_REASONS for w in members)

    def idle_worker(self, model: str, version: str) -> WorkerRecord | None:
        """The least loaded routable worker of a version with a free slot, while nothing
        queues for that version (extra work such as a mirrored copy must not wait or crowd)."""
        gate = self._gates.get(pool_name(model, version))
        if gate is not None and gate.scheduler.queued() > 0:
            return None
        free = [w for w in self._routable(model, version) if w.in_flight < w.capacity]
        return min(free, key=lambda w: w.in_flight / w.capacity, default=None)

    def key_for(self, worker_id: str | None) -> str | None:
        """The slot key of a worker's current incarnation (for affinity), if it is a member."""
        worker = self.membership.get(worker_id) if worker_id else None
        return slot_key(worker) if worker is not None else None

    def gate(self, model: str, version: str | None = None) -> AsyncGate:
        """The gate of a model's workers; of one version's only, when given (rollouts)."""
        name = pool_name(model, version)
        gate = self._gates.get(name)
        if gate is None:
            scheduler = PoolScheduler(self.policy, pool=name, observer=self.observer)
            gate = self._gates[name] = AsyncGate(scheduler, lambda: self._slots(model, version))
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
        await stop_task(self._task)
        self._task = None
