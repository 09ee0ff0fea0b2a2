"""The autoscaler at run time, in every router: report, campaign, and, while leader, decide.

Every router publishes its own windows (`ReportBoard`) and campaigns for
`<prefix>leader/autoscaler` (`LeaderLock`), so there is one decision maker however many
routers run. The leader, once per tick: reads every router's report and merges them per pool,
counts the pool's members through the executor, decides (`PoolAutoscaler.decide`, the pure
logic), writes the decision to `<prefix>scale/<pool>`, applies it through the executor and
exports it as `ballast_desired_replicas{pool}` (serving plus warm standby). Routers that do
not lead export no such gauge, so max() over routers is the leader's number.

A new leader starts with fresh decision state: cooldowns restart and a calm has to be proven
again before any scale-in, which errs on the side of capacity.

The reports, the campaign and the decisions share one `EtcdSession`: the router's when given
(the router closes it, after `stop()`), else the controller's own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict
from typing import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from services.common.etcd_session import ETCD_ERRORS, EtcdSession
from services.common.leader import LeaderLock
from services.common.membership import MembershipWatcher
from services.common.tasks import stop_task
from services.config import BallastConfig
from services.router.autoscale.board import ReportBoard
from services.router.autoscale.decision import Autoscaler, ScaleDecision
from services.router.autoscale.executor import RoleExecutor
from services.router.autoscale.observer import RouterObservations
from services.router.autoscale.report import merge

log = logging.getLogger(__name__)

LEADER_NAME = "autoscaler"


def decision_key(prefix: str, pool: str) -> str:
    return f"{prefix}scale/{pool}"


def decision_record(decision: ScaleDecision, leader: str) -> dict:
    """The decision as stored in etcd (and read by `ballast status`-like tools)."""
    return {
        "pool": decision.pool,
        "at": decision.at,
        "action": decision.action.value,
        "serving": decision.serving,
        "standby": decision.standby,
        "total": decision.total,
        "promote": decision.promote,
        "current": {"serving": decision.current.serving, "standby": decision.current.standby},
        "reason": decision.reason,
        "leader": leader,
        "signals": asdict(decision.signals),
    }


class AutoscalerController:
    def __init__(
        self,
        config: BallastConfig,
        router_id: str,
        membership: MembershipWatcher,
        observations: RouterObservations,
        executor: RoleExecutor,
        meter: Meter | None = None,
        clock: Callable[[], float] = time.time,
        session: EtcdSession | None = None,
    ) -> None:
        self.config = config
        self.settings = config.autoscaler
        self.policy = self.settings.policy()
        self.router_id = router_id
        self.membership = membership
        self.executor = executor
        self._clock = clock
        self._owns_session = session is None
        self.session = session or EtcdSession(config.etcd)
        self.board = ReportBoard(
            config.etcd,
            router_id,
            lambda: observations.report(router_id),
            self.settings.report_interval_s,
            clock,
            session=self.session,
        )
        self.lock = LeaderLock(config.etcd, LEADER_NAME, router_id, self.settings.leader_ttl_s, session=self.session)
        self._decider: Autoscaler | None = None
        self._task: asyncio.Task | None = None
        self.decisions: dict[str, ScaleDecision] = {}
        """The latest decision per pool while leader (empty otherwise)."""
        self.ticks = 0
        if meter is not None:
            self._export(meter)

    def _export(self, meter: Meter) -> None:
        def desired(_options: CallbackOptions) -> Iterable[Observation]:
            if self.lock.is_leader:
                for pool, decision in list(self.decisions.items()):
                    yield Observation(decision.total, {"pool": pool})

        def leader(_options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(1 if self.lock.is_leader else 0)

        meter.create_observable_gauge(
            "ballast_desired_replicas",
            callbacks=[desired],
            description="Replicas (serving plus warm standby) the elected autoscaler wants per pool.",
        )
        meter.create_observable_gauge(
            "ballast_autoscaler_leader",
            callbacks=[leader],
            description="1 on the router whose autoscaler holds the leader lock, else 0.",
        )

    async def start(self) -> None:
        await self.board.start()
        await self.lock.start()
        self._task = asyncio.create_task(self._run(), name="autoscaler")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        await self.lock.stop()
        await self.board.stop()
        await self.executor.close()
        if self._owns_session:
            await self.session.close()

    async def _run(self) -> None:
        while True:
            if self.lock.is_leader:
                try:
                    async with asyncio.timeout(max(self.settings.tick_s * 5, self.config.etcd.timeout_s * 3)):
                        await self.tick()
                except (*ETCD_ERRORS, TimeoutError) as exc:
                    # The failed (or cut) call dropped its client already: the next tick connects again.
                    log.warning("autoscaler tick failed, retrying next tick: %s", exc)
                except Exception:  # a bad tick (e.g. the Kubernetes API refusing) must not end the loop
                    log.exception("autoscaler tick failed")
            else:
                self._decider = None
                self.decisions = {}
            await asyncio.sleep(self.settings.tick_s)

    async def tick(self) -> dict[str, ScaleDecision]:
        """One round as leader: merge the reports, decide every pool, record, apply."""
        if self._decider is None:
            self._decider = Autoscaler(self.policy)
        reports = await self.board.read_all(self.session)
        workers = self.membership.workers()
        now = self._clock()
        decisions = {}
        for name, pool in self._decider.pools.items():
            signals = merge((r.pools[name] for r in reports if name in r.pools), pool.policy.min_samples)
            members = await self.executor.members(name, workers)
            decision = pool.decide(now, members.replicas(), signals)
            if decision.changed:
                log.info(
                    "pool %s: %s -> serving %d, standby %d (%s)",
                    name,
                    decision.action.value,
                    decision.serving,
                    decision.standby,
                    decision.reason,
                )
            await self.session.put(
                decision_key(self.config.etcd.prefix, name).encode(),
                json.dumps(decision_record(decision, self.router_id), sort_keys=True).encode(),
            )
            await self.executor.apply(decision, members)
            decisions[name] = decision
        self.decisions = decisions
        self.ticks += 1
        return decisions
