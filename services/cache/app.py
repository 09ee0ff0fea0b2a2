"""The KV-cache service process. It serves health and reflection and watches Redis; the
ballast.v1.KVCache API itself arrives with the session-KV work.

Health is SERVING only while Redis answers, so probes and routers see at once what the
service is missing; the `ballast_dependency_up{dependency="redis"}` gauge says the same.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
import redis.asyncio as redis_asyncio

from services.common.config import BallastConfig
from services.common.grpc_server import add_health_and_reflection, bind, new_server, set_serving
from services.common.probes import DependencyProbe
from services.common.telemetry import Telemetry

log = logging.getLogger(__name__)

SERVICE_NAME = "ballast.v1.KVCache"


@dataclass
class CacheApp:
    config: BallastConfig
    server: grpc.aio.Server
    port: int
    redis: redis_asyncio.Redis
    probe: DependencyProbe
    telemetry: Telemetry
    health: object

    @property
    def address(self) -> str:
        return f"{self.config.cache.host}:{self.port}"

    async def shutdown(self, grace_s: float = 5.0) -> None:
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.server.stop(grace_s)
        await self.probe.stop()
        await self.redis.aclose()
        self.telemetry.stop()


async def create_server(config: BallastConfig) -> CacheApp:
    telemetry = Telemetry("cache", config.telemetry)
    client = redis_asyncio.Redis.from_url(
        config.redis.url,
        socket_timeout=config.redis.timeout_s,
        socket_connect_timeout=config.redis.timeout_s,
    )
    server = new_server()
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = bind(server, config.cache.host, config.cache.port)

    async def on_change(up: bool) -> None:
        await set_serving(health, [SERVICE_NAME], up)

    probe = DependencyProbe(
        "redis", client.ping, telemetry.dependencies, timeout_s=config.redis.timeout_s, on_change=on_change
    )
    await server.start()
    telemetry.start()
    await probe.start()
    log.info("cache serving on %s:%d (redis %s)", config.cache.host, port, config.redis.url)
    return CacheApp(config, server, port, client, probe, telemetry, health)
