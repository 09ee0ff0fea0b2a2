"""The soak's Ballast phase: the local mesh, and how each fault is applied to it.

Two routers (clients balance over both), N workers under their keepers (a crashed worker is
forked again from a process that already imported the engine), the cache service on Redis,
the backfill service on the Kafka broker, and the autoscaler with one warm standby: when the
pool's p99 breaches, the leader promotes the standby. Workers report their temperature from
a file here (on a GPU it is NVML), so "80 C" is written there; the slowdown a hot GPU has is
applied as well, the same throttle the baseline's server gets.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import ContextManager

from bench.common import metric_sum
from bench.soak.faults import (
    COOL_C,
    ETCD_RESTART,
    HOT_C,
    KAFKA_DOWN,
    MESH_FAULTS,
    REDIS_RESTART,
    ROUTER_KILL,
    WORKER_FAULTS,
    WORKER_HOT,
    WORKER_KILL,
    WORKER_STALL,
    ScheduledFault,
    Throttle,
    Struck,
    Victims,
    signal_tree,
)
from services.cli.mesh import Mesh, MeshSpec, ServiceProcess
from services.common.processes import ProcessStartError
from services.common.leader import LeaderLock
from services.common.membership import ETCD_ERRORS, MembershipWatcher, make_client
from services.common.telemetry import DependencyStatus
from services.config import load_config
from services.router.autoscale.controller import LEADER_NAME as AUTOSCALER_LEADER, decision_key
from services.worker.keeper import serving_pid

POOL = "primary"
RECOVERY_LIMIT_S = 120.0


def autoscaler_overrides(workers: int, target_ms: float) -> dict:
    """One warm standby; a breach (90 % of the target p99 TTFT over 8 s) promotes it."""
    policy = {
        # Room for the promoted standby and a fresh one behind it, so a worker that drops out
        # and comes back (its keeper) does not have a standby started and stopped meanwhile.
        "min_replicas": workers,
        "max_replicas": workers + 2,
        "standby_replicas": 1,
        "target_p99_ttft_ms": target_ms,
        "calm_p99_ttft_ms": target_ms / 2,
        "latency_window_s": 8.0,
        "min_samples": 10,
        # One scale-out per soak, as the baseline's autoscaler makes; no scale-in during it.
        "scale_out_cooldown_s": 3600,
        "calm_for_s": 3600,
    }
    return {
        "enabled": True,
        "executor": "local",
        "tick_s": 0.5,
        "report_interval_s": 0.5,
        "pools": {POOL: policy},
        "local": {"stop_grace_s": 5},
    }


def mesh_spec(state_dir: Path, model_dir: Path, engine: str, workers: int, worker_extra: dict) -> MeshSpec:
    return MeshSpec(
        state_dir=state_dir,
        model_dir=model_dir,
        engine=engine,
        workers=workers,
        routers=2,
        worker_capacity=8,
        lease_ttl_s=3,
        worker_test_files=True,
        overrides={"worker": {"respawn": True, **worker_extra}},
    )


def enable_autoscaler(mesh: Mesh, workers: int, target_ms: float) -> None:
    """Turns the autoscaler on once the mesh's own workers serve: a leader that started with
    them would count a pool of none and start a whole pool of its own. The routers restart
    with the new config (before any traffic)."""
    mesh.spec.overrides["autoscaler"] = autoscaler_overrides(workers, target_ms)
    mesh.write_config()
    for router in mesh.routers():
        router.process.stop(timeout=40)
        mesh.restart_service(router)


def _in_flight(worker: ServiceProcess) -> float | None:
    """Streams the worker serves now (None: its metrics do not answer)."""
    return metric_sum(worker.metrics_port, ("ballast_worker_in_flight",))


class BallastSide:
    """The mesh as the chaos driver sees it (`bench.soak.faults.FaultTarget`)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._victims = Victims()

    def kinds(self) -> tuple[str, ...]:
        return WORKER_FAULTS + MESH_FAULTS

    def _worker_under_fault(self) -> ContextManager[ServiceProcess]:
        """The busiest serving worker not under another fault, for the block's length (waits
        for one, see `Victims`)."""

        def alive() -> list[ServiceProcess]:
            return [w for w in self.mesh.workers() if w.process.alive() and serving_pid(w.pid) is not None]

        return self._victims.busiest(alive, lambda w: w.name, lambda w: _in_flight(self.mesh.refresh_ready(w)))

    def _answers(self, worker: ServiceProcess) -> float | None:
        """When the worker answers on its metrics port again (it serves), or None. The port is
        read again each time: a worker its keeper started again meanwhile has a new one."""
        deadline = time.monotonic() + RECOVERY_LIMIT_S
        while time.monotonic() < deadline:
            if _in_flight(self.mesh.refresh_ready(worker)) is not None:
                return time.monotonic()
            time.sleep(0.1)
        return None

    def apply(self, fault: ScheduledFault) -> Struck:
        handlers = {
            WORKER_KILL: self._kill_worker,
            WORKER_STALL: self._stall_worker,
            WORKER_HOT: self._heat_worker,
            ROUTER_KILL: self._kill_router,
            REDIS_RESTART: self._restart_redis,
            KAFKA_DOWN: self._broker_down,
            ETCD_RESTART: self._restart_etcd,
        }
        return handlers[fault.kind](fault)

    def _kill_worker(self, fault: ScheduledFault) -> Struck:
        with self._worker_under_fault() as worker:
            offset = worker.process.log_path.stat().st_size
            struck_at = time.monotonic()
            # The serving process and its engine process (vLLM's runs apart): a dead GPU host.
            signal_tree(serving_pid(worker.pid), signal.SIGKILL)
            try:
                self.mesh.await_ready_after(worker, offset, timeout=RECOVERY_LIMIT_S)
            except ProcessStartError:
                return Struck(worker.name, struck_at, None)
            return Struck(worker.name, struck_at, time.monotonic())

    def _stall_worker(self, fault: ScheduledFault) -> Struck:
        with self._worker_under_fault() as worker:
            pid = serving_pid(worker.pid)
            struck_at = time.monotonic()
            signal_tree(pid, signal.SIGSTOP)
            time.sleep(fault.hold_s)
            signal_tree(pid, signal.SIGCONT)
            return Struck(worker.name, struck_at, self._answers(worker))

    def _heat_worker(self, fault: ScheduledFault) -> Struck:
        with self._worker_under_fault() as worker:
            struck_at = time.monotonic()
            temperature = self.mesh.temperature_file(worker.name)
            temperature.write_text(f"{HOT_C}\n")
            throttle = Throttle(serving_pid(worker.pid)).start()
            try:
                time.sleep(fault.hold_s)
            finally:
                throttle.stop()
                temperature.write_text(f"{COOL_C}\n")
            return Struck(worker.name, struck_at, self._answers(worker))

    def _autoscaler_holder(self) -> str:
        config = load_config(self.mesh.config_path, environ={})
        lock = LeaderLock(config.etcd, AUTOSCALER_LEADER, "bench-soak")
        return asyncio.run(lock.holder()) or ""

    def _kill_router(self, fault: ScheduledFault) -> Struck:
        # Not the autoscaler's leader: workers its executor started would outlive it, nobody's
        # to stop at the end. Its leadership moving is tests/integration/test_routers.py's.
        holder = self._autoscaler_holder()
        router = next(r for r in self.mesh.routers() if not holder.endswith(f"-{r.pid}"))
        struck_at = time.monotonic()
        os.kill(router.pid, signal.SIGKILL)
        router.process.wait()
        # Restarted as its orchestrator would; meanwhile the other router takes every call.
        fresh = self.mesh.restart_service(router, timeout=RECOVERY_LIMIT_S)
        return Struck(fresh.name, struck_at, time.monotonic())

    def _restart_redis(self, fault: ScheduledFault) -> Struck:
        struck_at = time.monotonic()
        self.mesh.redis.restart()
        return Struck("redis", struck_at, time.monotonic())

    def _broker_down(self, fault: ScheduledFault) -> Struck:
        struck_at = time.monotonic()
        self.mesh.kafka.stop()
        time.sleep(fault.hold_s)
        self.mesh.kafka.start()
        return Struck("kafka", struck_at, time.monotonic())

    def _restart_etcd(self, fault: ScheduledFault) -> Struck:
        struck_at = time.monotonic()
        self.mesh.etcd.restart()
        # Served again once every worker holds its registration again.
        try:
            self.mesh.wait_for_workers(len(self.mesh.workers()), RECOVERY_LIMIT_S)
        except ProcessStartError:
            return Struck("etcd", struck_at, None)
        return Struck("etcd", struck_at, time.monotonic())

    def fragmentation(self) -> list[float]:
        values = [
            metric_sum(w.metrics_port, ("ballast_worker_kv_fragmentation_ratio",))
            for w in self.mesh.workers()
            if w.process.alive()
        ]
        return [v for v in values if v is not None]

    def stalls(self) -> dict[str, dict[str, float]]:
        """What each worker and router still running says it waited on (see
        `stall_counts`), by process name, the workers the autoscaler started (the promoted
        standby among them) included; processes that do not answer are left out."""
        ports = {}
        for service in [*self.mesh.workers(), *self.mesh.routers()]:
            if service.process.alive():
                if service in self.mesh.workers():
                    self.mesh.refresh_ready(service)
                ports[service.name] = service.metrics_port
        ports.update(autoscaled_metrics_ports(self.mesh.state_dir / AUTOSCALED_LOGS))
        found = {}
        for name, port in ports.items():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2.0) as reply:
                    found[name] = stall_counts(reply.read().decode())
            except OSError:
                continue
        return found


# Where the routers' local autoscaler executor (its state_dir, relative to a router's working
# folder: the mesh's state folder) writes the logs of the workers it starts.
AUTOSCALED_LOGS = Path(".ballast") / "autoscale" / "logs"


def autoscaled_metrics_ports(logs: Path) -> dict[str, int]:
    """The metrics port of each worker the autoscaler started, from the last READY line of
    its log (`READY worker <address> metrics=<port>`), by worker id."""
    ports = {}
    for log in sorted(logs.glob("*.log")):
        ready = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("READY worker ")]
        if ready:
            ports[log.stem] = int(ready[-1].rsplit("metrics=", 1)[1])
    return ports


def _histogram_over(text: str, name: str, bound: str) -> float:
    """Observations of the histogram `name` above its bucket boundary `bound`."""
    count = bucket = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_bucket{{") and f'le="{bound}"' in line:
            bucket += float(line.rsplit(" ", 1)[1])
    return count - bucket


def stall_counts(text: str) -> dict[str, float]:
    """A process's own count, from its metrics' `text`, of the waits that leave a stream
    without tokens: its event loop running a due timer 1 s or 5 s late or more, and (a worker)
    its engine computing no step for 5 s or more while requests waited (the routers' stall
    timeout for tier A)."""
    lag = "ballast_event_loop_lag_milliseconds"
    gap = "ballast_worker_engine_step_gap_milliseconds"
    counts = {
        "loop_lags_over_1s": _histogram_over(text, lag, "1000"),
        "loop_lags_over_5s": _histogram_over(text, lag, "5000"),
    }
    if f"{gap}_count" in text:
        counts["engine_gaps_over_5s"] = _histogram_over(text, gap, "5000")
    return counts


class PromotionWatch:
    """Workers that became routable after `mark()`: a promoted standby or a new worker."""

    def __init__(self, mesh: Mesh) -> None:
        self.config = load_config(mesh.config_path, environ={})
        self.membership = MembershipWatcher(self.config.etcd, DependencyStatus())
        self.initial: set[str] = set()
        self._started_wall = 0.0
        self.first_new_at: float | None = None
        self.decided_at: float | None = None
        self._tasks: list[asyncio.Task] = []

    def routable(self) -> set[str]:
        return {w.id for w in self.membership.workers().values() if w.routable}

    def standby(self) -> set[str]:
        return {w.id for w in self.membership.workers().values() if w.standby}

    async def start(self, serving: int, timeout: float) -> None:
        await self.membership.start()
        deadline = time.monotonic() + timeout
        while not (len(self.routable()) >= serving and self.standby()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {serving} serving workers and a warm standby after {timeout:.0f}s")
            await asyncio.sleep(0.2)
        self.initial = self.routable()
        self._started_wall = time.time()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch()), loop.create_task(self._first_decision())]

    async def _watch(self) -> None:
        while self.first_new_at is None:
            if self.routable() - self.initial:
                self.first_new_at = time.monotonic()
            await asyncio.sleep(0.05)

    async def _first_decision(self) -> None:
        """Notes when (monotonic) the autoscaler's leader first decided a scale-out after
        `start`: the key holds only the latest decision, so it is read until one shows."""
        client = make_client(self.config.etcd)
        await client.connect()
        try:
            while self.decided_at is None:
                try:
                    got = await client.get(decision_key(self.config.etcd.prefix, POOL).encode())
                except ETCD_ERRORS:  # etcd restarting (a fault of the soak): read again
                    got = None
                decision = None if got is None else json.loads(got.value)
                if decision and decision.get("action") == "scale_out" and decision["at"] >= self._started_wall:
                    self.decided_at = time.monotonic() - (time.time() - decision["at"])
                await asyncio.sleep(0.1)
        finally:
            await client.close()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.membership.stop()
