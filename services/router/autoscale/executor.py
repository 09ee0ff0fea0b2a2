"""Carrying a pool's decision out: the shared part of every executor.

A decision is absolute (so many serving, so many warm standby), never "add one", so applying
it again on the next tick, or by the next leader, is harmless. Every executor first moves
roles: a warm standby is promoted through its role key when serving replicas are missing
(the fast path, well under a second), and a serving worker is demoted when the pool has
more serving and fewer standbys than wanted. What is still missing or extra after that is
the executor's own job: local processes (`LocalExecutor`), a Deployment's replica count
(`KubernetesExecutor`), or nobody (`RoleExecutor` alone: an HPA or KEDA follows the gauge).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from services.common.config import EtcdConfig
from services.common.etcd_session import EtcdSession
from services.common.membership import WorkerRecord
from services.common.worker_roles import SERVING, STANDBY, request_role
from services.router.autoscale.decision import Replicas, ScaleDecision

log = logging.getLogger(__name__)

ROLE_SETTLE_S = 10.0
"""A requested role counts as done this long at most, even if the worker's record lags."""


@dataclass
class PoolMembers:
    """A pool's workers as the executor counts them (oldest first within each role)."""

    pool: str
    serving: list[WorkerRecord] = field(default_factory=list)
    standby: list[WorkerRecord] = field(default_factory=list)
    starting_serving: int = 0
    """Replicas asked for that have not registered yet (processes or pods still loading)."""
    starting_standby: int = 0

    def replicas(self) -> Replicas:
        return Replicas(len(self.serving) + self.starting_serving, len(self.standby) + self.starting_standby)


@dataclass(frozen=True)
class RolePlan:
    """What it takes to go from the members to the decision."""

    promote: tuple[str, ...] = ()
    demote: tuple[str, ...] = ()
    start_serving: int = 0
    start_standby: int = 0
    stop_serving: int = 0
    stop_standby: int = 0


def plan_roles(decision: ScaleDecision, members: PoolMembers) -> RolePlan:
    """Promotions first (a standby serves in well under a second; a new replica takes a cold
    start), demotions before stops (a demoted replica stays warm for the next peak)."""
    serving_now = len(members.serving) + members.starting_serving
    standby_now = len(members.standby) + members.starting_standby
    promote: list[str] = []
    demote: list[str] = []
    start_serving = stop_serving = 0
    if decision.serving > serving_now:
        missing = decision.serving - serving_now
        promote = [w.id for w in members.standby[:missing]]
        start_serving = missing - len(promote)
        standby_now -= len(promote)
    elif decision.serving < serving_now:
        surplus = serving_now - decision.serving
        demotable = min(surplus, max(0, decision.standby - standby_now), len(members.serving))
        # The newest serving replicas go first: the oldest hold the warmest caches.
        demote = [w.id for w in members.serving[::-1][:demotable]]
        standby_now += len(demote)
        stop_serving = surplus - len(demote)
    start_standby = max(0, decision.standby - standby_now)
    stop_standby = max(0, standby_now - decision.standby)
    return RolePlan(tuple(promote), tuple(demote), start_serving, start_standby, stop_serving, stop_standby)


class RoleExecutor:
    """Moves roles through etcd; starts and stops nothing (replicas are someone else's job)."""

    kind = "none"

    def __init__(
        self, etcd: EtcdConfig, clock: Callable[[], float] = time.monotonic, session: EtcdSession | None = None
    ) -> None:
        self.etcd = etcd
        self._clock = clock
        # The router's session when given (the router closes it), else one of its own.
        self._owns_session = session is None
        self.session = session or EtcdSession(etcd)
        # worker id -> (role asked for, when): counted as done until the record agrees.
        self._requested: dict[str, tuple[str, float]] = {}

    def registered(self, pool: str, workers: Mapping[str, WorkerRecord]) -> PoolMembers:
        """The pool's registered workers by role, with roles just asked for taken as done."""
        now = self._clock()
        members = PoolMembers(pool)
        for worker in sorted(workers.values(), key=lambda w: (w.started_at, w.id)):
            if worker.pool != pool or worker.draining:
                continue  # a draining worker is on its way out: it is no capacity
            role = STANDBY if worker.standby else SERVING
            asked = self._requested.get(worker.id)
            if asked is not None:
                if asked[0] == role or now - asked[1] > ROLE_SETTLE_S:
                    del self._requested[worker.id]
                else:
                    role = asked[0]
            (members.standby if role == STANDBY else members.serving).append(worker)
        return members

    async def members(self, pool: str, workers: Mapping[str, WorkerRecord]) -> PoolMembers:
        return self.registered(pool, workers)

    async def apply(self, decision: ScaleDecision, members: PoolMembers) -> RolePlan:
        plan = plan_roles(decision, members)
        workers = {w.id: w for w in members.serving + members.standby}
        for worker_id in plan.promote:
            await self._ask(workers[worker_id], SERVING)
        for worker_id in plan.demote:
            await self._ask(workers[worker_id], STANDBY)
        if plan.promote or plan.demote:
            log.info("pool %s: promoted %s, demoted %s", decision.pool, list(plan.promote), list(plan.demote))
        return plan

    async def _ask(self, worker: WorkerRecord, role: str) -> None:
        await request_role(self.session, self.etcd, worker.id, role, worker.lease_id)
        self._requested[worker.id] = (role, self._clock())

    async def close(self) -> None:
        if self._owns_session:
            await self.session.close()
