"""The backfill service process. It serves health and reflection and watches the Kafka
broker; consuming the degraded-request topic arrives with the degradation work.

Health is SERVING only while the broker answers; `ballast_dependency_up{dependency="kafka"}`
says the same to Prometheus.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from confluent_kafka.admin import AdminClient

from services.common.config import BallastConfig
from services.common.grpc_server import add_health_and_reflection, bind, new_server, set_serving
from services.common.probes import DependencyProbe
from services.common.telemetry import Telemetry

log = logging.getLogger(__name__)

SERVICE_NAME = "ballast.v1.Backfill"


@dataclass
class BackfillApp:
    config: BallastConfig
    server: grpc.aio.Server
    port: int
    probe: DependencyProbe
    telemetry: Telemetry
    health: object

    @property
    def address(self) -> str:
        return f"{self.config.backfill.host}:{self.port}"

    async def shutdown(self, grace_s: float = 5.0) -> None:
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.server.stop(grace_s)
        await self.probe.stop()
        self.telemetry.stop()


async def create_server(config: BallastConfig) -> BackfillApp:
    telemetry = Telemetry("backfill", config.telemetry)
    admin = AdminClient({"bootstrap.servers": config.kafka.bootstrap, "log_level": 3})
    server = new_server()
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = bind(server, config.backfill.host, config.backfill.port)

    async def check_broker() -> None:
        # librdkafka calls block: keep them off the event loop.
        await asyncio.to_thread(admin.list_topics, timeout=config.kafka.timeout_s)

    async def on_change(up: bool) -> None:
        await set_serving(health, [SERVICE_NAME], up)

    probe = DependencyProbe(
        "kafka", check_broker, telemetry.dependencies, interval_s=2.0,
        timeout_s=config.kafka.timeout_s + 1, on_change=on_change,
    )
    await server.start()
    telemetry.start()
    await probe.start()
    log.info("backfill serving on %s:%d (kafka %s)", config.backfill.host, port, config.kafka.bootstrap)
    return BackfillApp(config, server, port, probe, telemetry, health)
