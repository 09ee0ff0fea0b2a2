"""The router process: membership watch + the public Inference server, and (with
router.http_port set) the OpenAI-compatible HTTP front on the same request path.

Stateless: run as many replicas as needed behind any L4/L7 balancer. Shutdown order:
health NOT_SERVING, server.stop(grace) lets open streams finish, then the autoscaler resigns,
the watches stop, worker channels and telemetry close, and the etcd session goes last.

The router holds one etcd session (one client, one reconnect loop): this module builds it and
hands it to everything that reaches etcd (membership, tiering rules, quarantine, rollouts,
autoscaler), and closes it once they all stopped.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from ballast.v1 import inference_pb2, inference_pb2_grpc
from services.common.etcd_session import EtcdSession
from services.common.etcd_watch import KeyWatcher
from services.common.grpc_server import add_health_and_reflection, bind, bind_health_port, new_server, set_serving
from services.common.membership import MembershipWatcher
from services.common.tls.credentials import public_server_credentials
from services.common.tls.roles import HEALTH_ONLY, PUBLIC_PLAINTEXT
from services.common.telemetry import Telemetry
from services.config import BallastConfig
from services.router.autoscale.controller import AutoscalerController
from services.router.autoscale.runtime import router_identity, start_autoscaler
from services.router.backfill_proxy import BackfillProxy
from services.router.metrics import RouterMetrics
from services.router.openai.server import OpenAIFront
from services.router.resilience.quarantine import RouterQuarantine
from services.router.scheduling.tagging import TIERING_KEY
from services.router.servicer import InferenceServicer
from services.router.worker_clients import WorkerClients

log = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


@dataclass
class RouterApp:
    config: BallastConfig
    server: grpc.aio.Server
    port: int
    membership: MembershipWatcher
    clients: WorkerClients
    servicer: InferenceServicer
    telemetry: Telemetry
    health: object
    rules_watch: KeyWatcher
    # The process's one etcd session, under every watch, lease and call above; closed last.
    etcd: EtcdSession
    _sweeper: asyncio.Task | None = None
    # The autoscaler's reports, leader campaign and (while leader) decisions; None when off.
    autoscaler: AutoscalerController | None = None
    # The OpenAI-compatible HTTP front; None when router.http_port is unset.
    http: OpenAIFront | None = None

    @property
    def address(self) -> str:
        return f"{self.config.router.host}:{self.port}"

    @property
    def http_address(self) -> str | None:
        return None if self.http is None else f"{self.config.router.host}:{self.http.port}"

    async def _sweep_channels(self) -> None:
        # Close channels of workers that left, whenever the membership changes.
        while True:
            before = {w.address for w in self.membership.workers().values()}
            await self.membership.wait_for(
                lambda workers: {w.address for w in workers.values()} != before, timeout=30.0
            )
            await self.clients.retain({w.address for w in self.membership.workers().values()})

    async def shutdown(self, grace_s: float | None = None) -> None:
        grace = self.config.router.shutdown_grace_s if grace_s is None else grace_s
        await set_serving(self.health, [SERVICE_NAME], False)
        if self.http is not None:
            await asyncio.gather(self.server.stop(grace), self.http.stop())
        else:
            await self.server.stop(grace)
        await self.servicer.degrader.stop()
        if self.autoscaler is not None:
            # Resigns leadership at once, so another router decides without waiting a TTL.
            await self.autoscaler.stop()
        if self.servicer.backfill is not None:
            await self.servicer.backfill.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.rules_watch.stop()
        await self.servicer.runner.quarantine.stop()
        await self.servicer.rollouts.stop()
        await self.servicer.pools.stop()
        await self.servicer.routing_view.stop()
        await self.membership.stop()
        await self.clients.close()
        self.telemetry.stop()
        # Last: every part above used it, and none closes a session it was given.
        await self.etcd.close()


async def create_server(config: BallastConfig) -> RouterApp:
    """Starts watching membership and serving on the configured port (0 picks one)."""
    telemetry = Telemetry("router", config.telemetry)
    etcd = EtcdSession(config.etcd)
    membership = MembershipWatcher(config.etcd, telemetry.dependencies, etcd)
    await membership.start()
    clients = WorkerClients(config.tls)
    servicer = InferenceServicer(config, membership, clients, RouterMetrics(telemetry))
    await servicer.pools.start()
    await servicer.routing_view.start()
    await servicer.degrader.start()
    servicer.backfill = BackfillProxy.from_config(config, telemetry)
    await servicer.backfill.start()
    rules_watch = KeyWatcher(config.etcd, f"{config.etcd.prefix}{TIERING_KEY}", servicer.rules_changed, etcd)
    await rules_watch.start()
    # The servicer builds the controller without etcd access; it gets the session here.
    await servicer.rollouts.start(etcd)
    # The quarantine shared with the other routers and the backfill through etcd.
    servicer.runner.quarantine = RouterQuarantine(
        config.router.quarantine, config.etcd, counter=servicer.metrics.quarantine, session=etcd
    )
    await servicer.runner.quarantine.start()
    credentials = public_server_credentials(config.tls, "router")
    # With a plaintext public port (public_tls off, TLS ended at a balancer) the public API
    # and reflection are served without TLS too; otherwise only health checks are.
    server = new_server(
        tls=config.tls,
        plaintext_services=HEALTH_ONLY if config.tls.public_port_secure else PUBLIC_PLAINTEXT,
        reuse_port=config.router.processes > 1,
    )
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = bind(server, config.router.host, config.router.port, credentials)
    bind_health_port(server, config.router.host, config.tls)
    await server.start()
    telemetry.start()
    await set_serving(health, [SERVICE_NAME], True)
    app = RouterApp(config, server, port, membership, clients, servicer, telemetry, health, rules_watch, etcd)
    if config.router.http_port is not None:
        app.http = OpenAIFront(servicer)
        await app.http.start(config.router.host, config.router.http_port)
        log.info("router OpenAI-compatible HTTP on %s://%s/v1", app.http.scheme, app.http_address)
    app._sweeper = asyncio.create_task(app._sweep_channels())
    app.autoscaler = await start_autoscaler(config, membership, servicer, telemetry, router_identity(port), etcd)
    log.info("router serving on %s", app.address)
    return app
