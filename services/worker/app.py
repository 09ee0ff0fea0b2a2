"""The worker process: engine + gRPC server + etcd registration, started and stopped in order.

Shutdown order (SIGTERM): health NOT_SERVING and draining published at once, in-flight
streams finish within the grace period, the lease is revoked, the server stops, the engine
is released, telemetry stops, and the etcd session closes last.

A worker reaches etcd through one session (its registration, its role watch, a sim worker's
fault watch): its own, built here, or the one a sim host shares among its workers (the host
closes that one).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import grpc

from ballast.v1 import worker_pb2, worker_pb2_grpc
from services.config import BallastConfig
from services.common.etcd_session import EtcdSession
from services.common.grpc_server import add_health_and_reflection, bind, bind_health_port, new_server, set_serving
from services.common.membership import WorkerRecord, WorkerRegistration
from services.common.tls.credentials import server_credentials
from services.common.telemetry import Telemetry
from services.worker.engine import Engine, Stepping
from services.worker.engine_watch import EngineStallWatch
from services.worker.kv import SessionKV, start_session_kv
from services.worker.metrics import WorkerMetrics
from services.worker.servicer import FaultInjector, WorkerServicer, WorkerState
from services.worker.standby import StandbyControl
from services.worker.temperature import TemperatureSource

if TYPE_CHECKING:
    from services.worker.sim.control import SimFaultControl

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def make_engine(config: BallastConfig) -> Engine:
    worker = config.worker
    if worker.engine == "torch":
        from services.worker.torch.engine import TorchEngine

        return TorchEngine(
            model_dir=worker.model_dir,
            model_name=worker.model_name,
            max_concurrency=worker.max_concurrency,
            device=worker.device,
            memory_sessions=worker.kv_memory_sessions,
            runtime=worker.torch_runtime,
            max_batch=worker.max_batch,
        )
    if worker.engine == "vllm":
        # vLLM itself is imported at start(), so a missing `gpu` extra fails there, named.
        from services.worker.vllm import VllmEngine, VllmSettings

        return VllmEngine(worker.model_dir, worker.model_name, VllmSettings.from_worker_config(worker, config.tls))
    if worker.engine == "sim":
        from services.worker.sim import SimEngine, SimProfile

        from services.worker.sim.faults import SimFaults

        return SimEngine(
            worker.model_dir,
            worker.model_name,
            SimProfile.load(worker.sim_profile),
            max_concurrency=worker.max_concurrency,
            faults=SimFaults.from_dict(worker.sim_faults),
        )
    raise ValueError(f"config field 'worker.engine': engine {worker.engine!r} is not available here")


@dataclass
class WorkerApp:
    config: BallastConfig
    worker_id: str
    engine: Engine
    server: grpc.aio.Server
    port: int
    state: WorkerState
    telemetry: Telemetry
    registration: WorkerRegistration
    health: object
    temperature: TemperatureSource
    # The etcd session under the registration and the watches; closed last by shutdown() when
    # the app built it (`owns_etcd`), left to its owner (a sim host) otherwise.
    etcd: EtcdSession
    owns_etcd: bool = True
    # Session KV persistence through the cache service (None: worker.cache_address unset).
    session_kv: SessionKV | None = None
    # Warm standby role and its watch (promotion by the autoscaler).
    standby: StandbyControl | None = None
    # A sim worker's fault knobs; None for real engines.
    sim_faults: SimFaultControl | None = None
    # Gaps between engine steps while requests wait (None: an engine that does not count steps).
    engine_watch: EngineStallWatch | None = None
    # The Worker service, whose Relay streams the stop ends itself (routers keep them open).
    servicer: WorkerServicer | None = None
    # Published in every record: fixed for the process, so an unchanged worker's record is
    # unchanged (and not written again), and the autoscaler's oldest-first order holds still.
    started_at: float = field(default_factory=time.time)

    @property
    def address(self) -> str:
        host = self.config.worker.advertise_host or self.config.worker.host
        return f"{host}:{self.port}"

    def record(self) -> WorkerRecord:
        stats = self.engine.stats()
        model = self.engine.model
        return WorkerRecord(
            id=self.worker_id,
            address=self.address,
            model=model.name,
            model_version=model.version,
            pool=self.config.worker.pool,
            capacity=self.state.capacity,
            in_flight=self.state.in_flight,
            queued=stats.waiting,
            kv_used=round(stats.kv_used, 4),
            temperature_c=self.temperature.read(),
            healthy=not self.state.draining and not self.is_standby and not self.fails_health,
            draining=self.state.draining,
            standby=self.is_standby,
            max_context=model.max_context,
            relay=self.config.worker.relay,
            started_at=self.started_at,
        )

    @property
    def fails_health(self) -> bool:
        return self.sim_faults is not None and self.sim_faults.unhealthy

    @property
    def is_standby(self) -> bool:
        return self.standby is not None and self.standby.standby

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Drains and stops; safe to call twice."""
        grace = self.config.worker.drain_grace_s if grace_s is None else grace_s
        if not self.state.draining:
            self.state.draining = True
            await set_serving(self.health, [SERVICE_NAME], False)
            self.registration.publish_now()
            log.info("draining: %d in flight, grace %.1fs", self.state.in_flight, grace)
            if not await self.state.wait_idle(grace):
                handed = self.state.hand_off_all()
                log.warning("grace period over: handed %d streams back to the router", handed)
                await self.state.wait_idle(5.0)
        # Every step is bounded: a stop that hangs must not keep the process (or a rolling
        # restart) waiting forever.
        if self.standby is not None:
            await _bounded("standby watch stop", self.standby.stop(), 5.0)
        if self.sim_faults is not None:
            await _bounded("sim fault watch stop", self.sim_faults.stop(), 5.0)
        await _bounded("etcd deregistration", self.registration.stop(), 10.0)
        if self.servicer is not None:
            # Drained by now: ending the Relay streams here spares the stop waiting out its grace.
            self.servicer.close_relays()
        await _bounded("gRPC server stop", self.server.stop(1.0), 5.0)
        if self.session_kv is not None:
            # The drained streams queued their sessions' KV; write it before the engine goes.
            await _bounded("KV save flush", self.session_kv.stop(flush_timeout_s=5.0), 10.0)
            self.session_kv = None
        if self.engine_watch is not None:
            self.engine_watch.stop()
        await _bounded("engine stop", self.engine.stop(), 15.0)
        self.telemetry.stop()
        if self.owns_etcd:
            await _bounded("etcd session close", self.etcd.close(), 5.0)


async def _bounded(what: str, awaitable, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        log.warning("%s did not finish within %.0fs; shutting down anyway", what, timeout_s)


def _default_worker_id(host: str, port: int) -> str:
    return f"{socket.gethostname()}-{port}-{os.getpid()}"


def _exit_now() -> None:
    """A sim worker told to crash: the process ends as a killed one would, no drain, no
    deregistration (the lease expires)."""
    log.warning("sim fault: crashing now")
    os._exit(70)


async def create_server(
    config: BallastConfig,
    engine: Engine | None = None,
    on_crash: Callable[[], None] = _exit_now,
    etcd: EtcdSession | None = None,
) -> WorkerApp:
    """Loads the engine, starts serving on the configured port (0 picks one), registers.
    `on_crash`: what a sim worker's `crash` knob does (by default the process exits). `etcd`:
    the process's session when several workers share one (its owner closes it); by default
    the worker builds its own and closes it at shutdown."""
    engine = engine or make_engine(config)
    await engine.start()
    telemetry = Telemetry("worker", config.telemetry)
    state = WorkerState(config.worker.max_concurrency, config.worker.max_queue)
    server = new_server(tls=config.tls)
    port = bind(server, config.worker.host, config.worker.port, server_credentials(config.tls, "worker"))
    bind_health_port(server, config.worker.host, config.tls)
    worker_id = config.worker.id or _default_worker_id(config.worker.host, port)
    metrics = WorkerMetrics(telemetry, engine.stats, lambda: state.in_flight)
    servicer = WorkerServicer(
        engine,
        state,
        metrics,
        worker_id,
        config.worker.pool,
        FaultInjector(config.worker.fault_file),
        b_tier_flush_s=config.worker.b_tier_flush_ms / 1000,
        engine_progress_s=config.worker.engine_progress_ms / 1000,
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    app = WorkerApp(
        config=config,
        worker_id=worker_id,
        engine=engine,
        server=server,
        port=port,
        state=state,
        telemetry=telemetry,
        registration=None,  # type: ignore[arg-type]  # set just below; needs app.record
        health=health,
        temperature=TemperatureSource(config.worker.temperature_file),
        etcd=etcd or EtcdSession(config.etcd),
        owns_etcd=etcd is None,
        servicer=servicer,
    )
    metrics.observe_temperature(app.temperature.read)
    app.session_kv = await start_session_kv(config.worker, engine, telemetry, health, tls=config.tls)
    app.registration = WorkerRegistration(config.etcd, app.record, telemetry.dependencies, app.etcd)
    app.standby = StandbyControl(
        config.etcd, worker_id, engine, config.worker.standby, app.registration.publish_now, app.etcd
    )
    await server.start()
    telemetry.start()
    if isinstance(engine, Stepping):
        app.engine_watch = EngineStallWatch(
            engine,
            lambda: state.in_flight,
            telemetry,
            interval_s=config.worker.engine_watch_interval_s,
            warn_s=config.worker.engine_stall_warn_s,
        )
        app.engine_watch.start()
    await set_serving(health, [SERVICE_NAME], True)
    if config.worker.engine == "sim":
        from services.worker.sim.control import SimFaultControl

        async def set_health(serving: bool) -> None:
            await set_serving(health, [SERVICE_NAME], serving)
            app.registration.publish_now()

        app.sim_faults = SimFaultControl(
            config.etcd, worker_id, engine, app.temperature, servicer.faults, set_health, on_crash, app.etcd
        )
        await app.sim_faults.start()
    await app.registration.start()
    await app.standby.start()
    try:
        # Ready means registered, when etcd is there; without etcd the worker still serves
        # direct calls and keeps trying to register in the background.
        await asyncio.wait_for(app.registration.registered.wait(), config.etcd.timeout_s * 2)
    except asyncio.TimeoutError:
        log.warning("not registered in etcd yet; retrying in the background")
    log.info(
        "worker %s %s %s (%s) on %s",
        worker_id,
        "warm standby for" if app.is_standby else "serving",
        engine.model.name,
        engine.model.version,
        app.address,
    )
    return app
