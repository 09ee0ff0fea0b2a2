"""The local executor: worker processes on this machine, for `ballast up` and the benchmarks.

Replicas still missing after promotions are cold-started as `python -m services.worker`
children (serving, or warm standby with `worker.standby`), each with the router's own
configuration (written once to a file under `autoscaler.local.state_dir`), its own id and a
free port. A started worker counts as capacity on its way until it registers, so the next
tick does not start it twice; one that neither registers within `start_timeout_s` nor stays
alive is dropped, and the pool's next start waits (`start_backoff_initial_s`, doubling with
each failed start in a row up to `start_backoff_max_s`, from the first again once a started
worker registers): a worker that cannot start (a bad model path, a host too busy to load it)
is not replaced by a fresh process every tick, each paying the model's load again. Extra replicas are stopped with SIGTERM (they drain), newest first, and
only among the workers this executor started: others belong to whoever launched them.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import yaml

from services.common.backoff import BackoffPolicy, RestartBackoff
from services.common.etcd_session import EtcdSession
from services.common.membership import WorkerRecord
from services.common.processes import ManagedProcess
from services.common.tasks import stop_task
from services.common.worker_roles import SERVING, STANDBY
from services.config import BallastConfig
from services.router.autoscale.decision import ScaleDecision
from services.router.autoscale.executor import PoolMembers, RoleExecutor, RolePlan

log = logging.getLogger(__name__)


@dataclass
class LocalWorker:
    worker_id: str
    pool: str
    role: str
    """The role it was started in (its record says the current one once registered)."""
    process: ManagedProcess
    started_at: float
    registered: bool = False
    stopping: bool = False


class LocalExecutor(RoleExecutor):
    kind = "local"

    def __init__(
        self,
        config: BallastConfig,
        router_id: str,
        clock: Callable[[], float] = time.monotonic,
        session: EtcdSession | None = None,
    ) -> None:
        super().__init__(config.etcd, clock, session)
        self.config = config
        self.settings = config.autoscaler.local
        self.router_id = router_id
        self.state_dir = Path(self.settings.state_dir).resolve()
        self.children: dict[str, LocalWorker] = {}
        self._seq = 0
        self._config_path: Path | None = None
        self._stops: set[asyncio.Task] = set()
        # Per pool: its failed starts in a row, and until when its next start waits.
        self._start_backoff = BackoffPolicy(
            initial_s=self.settings.start_backoff_initial_s, max_s=self.settings.start_backoff_max_s
        )
        self._failed_starts: dict[str, RestartBackoff] = {}
        self._starts_held_until: dict[str, float] = {}

    # -- counting -----------------------------------------------------------------------

    async def members(self, pool: str, workers: Mapping[str, WorkerRecord]) -> PoolMembers:
        self._reap(workers)
        members = self.registered(pool, workers)
        for child in self.children.values():
            if child.pool == pool and not child.registered and not child.stopping:
                if child.role == STANDBY:
                    members.starting_standby += 1
                else:
                    members.starting_serving += 1
        return members

    def _reap(self, workers: Mapping[str, WorkerRecord]) -> None:
        now = self._clock()
        for worker_id, child in list(self.children.items()):
            if worker_id in workers and not child.registered:
                child.registered = True
                self._start_succeeded(child.pool)
            if not child.process.alive():
                if not child.stopping:
                    log.warning(
                        "worker %s exited (status %s); log: %s",
                        worker_id,
                        child.process.exit_status(),
                        child.process.log_path,
                    )
                    if not child.registered:
                        self._start_failed(child.pool)
                del self.children[worker_id]
            elif not child.registered and not child.stopping and now - child.started_at > self.settings.start_timeout_s:
                log.warning(
                    "worker %s did not register within %.0fs; stopping it", worker_id, self.settings.start_timeout_s
                )
                self._stop(child)
                self._start_failed(child.pool)

    # -- failed starts ----------------------------------------------------------------------

    def _start_failed(self, pool: str) -> None:
        backoff = self._failed_starts.setdefault(pool, RestartBackoff(self._start_backoff))
        wait_s = backoff.next_delay(0.0)
        self._starts_held_until[pool] = self._clock() + wait_s
        log.warning(
            "pool %s: %d failed worker starts in a row; the next start waits %.0fs", pool, backoff.streak, wait_s
        )

    def _start_succeeded(self, pool: str) -> None:
        self._failed_starts.pop(pool, None)
        self._starts_held_until.pop(pool, None)

    def starts_held_s(self, pool: str) -> float:
        """How long the pool's next start still waits after failed starts (0: none)."""
        return max(0.0, self._starts_held_until.get(pool, 0.0) - self._clock())

    # -- acting ---------------------------------------------------------------------------

    async def apply(self, decision: ScaleDecision, members: PoolMembers) -> RolePlan:
        plan = await super().apply(decision, members)
        # Promotions and stops go ahead; starts wait out the pool's failed-start backoff (said
        # once, when it began, not at every tick).
        if not self.starts_held_s(decision.pool):
            for _ in range(plan.start_serving):
                self.start_worker(decision.pool, SERVING)
            for _ in range(plan.start_standby):
                self.start_worker(decision.pool, STANDBY)
        self._stop_extra(decision.pool, SERVING, plan.stop_serving, members)
        self._stop_extra(decision.pool, STANDBY, plan.stop_standby, members)
        return plan

    def _worker_config(self) -> Path:
        if self._config_path is None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            path = self.state_dir / f"worker-config-{self.router_id}.yaml"
            path.write_text(
                "# Written by the router's local autoscaler executor: the router's own configuration.\n"
                + yaml.safe_dump(self.config.model_dump(mode="json"), sort_keys=False)
            )
            self._config_path = path
        return self._config_path

    def start_worker(self, pool: str, role: str) -> LocalWorker:
        self._seq += 1
        worker_id = f"{pool}-{self.router_id}-{self._seq}"
        env = {
            "BALLAST_CONFIG": str(self._worker_config()),
            "PYTHONUNBUFFERED": "1",
            "BALLAST__WORKER__ID": worker_id,
            "BALLAST__WORKER__POOL": pool,
            "BALLAST__WORKER__STANDBY": "true" if role == STANDBY else "false",
            # Fixed ports in the router's configuration would clash: every worker picks its own.
            "BALLAST__WORKER__PORT": "0",
            "BALLAST__TELEMETRY__METRICS_PORT": "0",
        }
        process = ManagedProcess(
            worker_id,
            [sys.executable, "-m", "services.worker"],
            log_path=self.state_dir / "logs" / f"{worker_id}.log",
            env=env,
            cwd=self.state_dir,
        )
        process.start()
        child = self.children[worker_id] = LocalWorker(worker_id, pool, role, process, self._clock())
        log.info("started worker %s (%s) for pool %s, pid %s", worker_id, role, pool, process.pid)
        return child

    def _stop_extra(self, pool: str, role: str, count: int, members: PoolMembers) -> None:
        if count <= 0:
            return
        in_role = {w.id for w in (members.standby if role == STANDBY else members.serving)}
        mine = [
            child
            for child in self.children.values()
            if child.pool == pool
            and not child.stopping
            and (child.worker_id in in_role or (not child.registered and child.role == role))
        ]
        # Newest first: a worker still loading is the cheapest to give up.
        victims = sorted(mine, key=lambda c: c.started_at, reverse=True)[:count]
        for child in victims:
            self._stop(child)
        if len(victims) < count:
            log.info("pool %s: %d %s replicas too many, but only %d were started here", pool, count, role, len(victims))

    def _stop(self, child: LocalWorker) -> None:
        child.stopping = True
        log.info("stopping worker %s (pid %s)", child.worker_id, child.process.pid)
        # ManagedProcess.stop blocks while the worker drains: off the loop, and not awaited
        # by the tick.
        task = asyncio.create_task(asyncio.to_thread(child.process.stop, self.settings.stop_grace_s))
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)

    async def close(self) -> None:
        """Stops every worker this executor started (they drain in parallel), then waits."""
        for child in self.children.values():
            if not child.stopping:
                self._stop(child)
        if self._stops:
            await asyncio.wait(set(self._stops), timeout=self.settings.stop_grace_s + 10.0)
        for task in list(self._stops):
            await stop_task(task, timeout_s=1.0)
        self.children.clear()
        await super().close()
