"""The KV-cache service process: `ballast.v1.KVCache` over Redis, with health and reflection.

Health is SERVING only while Redis answers, so probes, workers and routers see at once what
the service is missing; the `ballast_dependency_up{dependency="redis"}` gauge says the same.
The same once-a-second probe reads Redis's eviction count, so evictions under the memory
bound show up in this service's metrics. With Redis down every call fails UNAVAILABLE
(workers then recompute); the service itself keeps running and recovers on its own.
"""

from __future__ import annotations

import asyncio

import logging
from dataclasses import dataclass

import grpc
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ballast.v1 import kvcache_pb2, kvcache_pb2_grpc
from services.cache.metrics import CacheMetrics
from services.cache.servicer import KVCacheServicer
from services.cache.store import RedisKVStore, StoreLimits
from services.common.config import RedisConfig
from services.common.grpc_server import add_health_and_reflection, bind, bind_health_port, new_server, set_serving
from services.common.probes import DependencyProbe
from services.common.redis_client import AnyRedis, cluster_health, info_per_master, is_cluster, make_client
from services.common.telemetry import Telemetry
from services.common.tls.credentials import server_credentials
from services.config import BallastConfig

log = logging.getLogger(__name__)

SERVICE_NAME = kvcache_pb2.DESCRIPTOR.services_by_name["KVCache"].full_name


class EvictionWatch:
    """Turns Redis's cumulative `evicted_keys` into a counter of evictions seen from here (summed
    over the masters of a cluster), and reads a cluster's health for the metrics.

    Its check is the service's Redis probe: it fails while the server, or any master of a
    cluster, does not answer."""

    def __init__(self, client: AnyRedis, metrics: CacheMetrics) -> None:
        self._client = client
        self._metrics = metrics
        self._last: int | None = None

    async def check(self) -> None:
        if is_cluster(self._client):
            # Read before the statistics, so the gauges show a failing cluster too.
            self._metrics.cluster_seen(await cluster_health(self._client))
        if self._last is None:
            await self._warn_if_unbounded()
        stats = await info_per_master(self._client, "stats")
        current = sum(int(s.get("evicted_keys", 0)) for s in stats)
        if self._last is not None:
            # A smaller count means a server restarted (or a master changed) and began again.
            self._metrics.evictions_seen(current - self._last if current >= self._last else current)
        self._last = current

    async def _warn_if_unbounded(self) -> None:
        for memory in await info_per_master(self._client, "memory"):
            policy = str(memory.get("maxmemory_policy", ""))
            if not int(memory.get("maxmemory", 0)) or policy == "noeviction":
                # Blocks then only leave by TTL, and a full Redis refuses new ones (rejected blocks).
                log.warning(
                    "redis has no memory bound with eviction (maxmemory=%s, policy=%s); "
                    "set maxmemory and the volatile-lru policy for the KV cache",
                    memory.get("maxmemory"),
                    policy,
                )
                return
            if policy.startswith("allkeys-"):
                # Every KV block carries a TTL and the backfill's answers none: only a volatile-*
                # policy keeps cache pressure off the answers users were promised.
                log.warning(
                    "redis evicts with %s: KV traffic can evict the backfill's better answers; "
                    "set maxmemory-policy volatile-lru",
                    policy,
                )
                return


@dataclass
class CacheApp:
    config: BallastConfig
    server: grpc.aio.Server
    port: int
    redis: AnyRedis
    probe: DependencyProbe
    telemetry: Telemetry
    health: object
    store: RedisKVStore
    metrics: CacheMetrics

    @property
    def address(self) -> str:
        return f"{self.config.cache.host}:{self.port}"

    async def shutdown(self, grace_s: float = 5.0) -> None:
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.server.stop(grace_s)
        await self.probe.stop()
        try:
            # Bounded: a Redis that vanished must not keep the service from stopping.
            await asyncio.wait_for(self.redis.aclose(), 5.0)
        except asyncio.TimeoutError:
            log.warning("closing the Redis client timed out; stopping anyway")
        self.telemetry.stop()


def redis_client(config: RedisConfig) -> AnyRedis:
    """A client for `config` (its URL, ACL user and TLS files; one server or a cluster)."""
    timeout_s = config.timeout_s
    # One quick retry re-dials a connection Redis dropped (after its restart); more would
    # only delay the UNAVAILABLE a worker needs to fall back to recomputing.
    return make_client(
        config,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
        health_check_interval=0,
        # Blocks are hundreds of KiB: read the socket in large pieces.
        socket_read_size=1 << 20,
    )


async def create_server(config: BallastConfig) -> CacheApp:
    telemetry = Telemetry("cache", config.telemetry)
    client = redis_client(config.redis)
    metrics = CacheMetrics(telemetry)
    cache = config.cache
    store = RedisKVStore(
        client, StoreLimits(cache.key_prefix, cache.ttl_s, cache.max_ttl_s, cache.batch_bytes), metrics
    )
    server = new_server(tls=config.tls)
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(KVCacheServicer(store, cache, config.redis, metrics), server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = bind(server, cache.host, cache.port, server_credentials(config.tls, "cache"))
    bind_health_port(server, cache.host, config.tls)

    async def on_change(up: bool) -> None:
        await set_serving(health, [SERVICE_NAME], up)

    probe = DependencyProbe(
        "redis",
        EvictionWatch(client, metrics).check,
        telemetry.dependencies,
        timeout_s=config.redis.timeout_s,
        on_change=on_change,
    )
    await server.start()
    telemetry.start()
    await probe.start()
    log.info("cache serving on %s:%d (redis %s)", cache.host, port, config.redis.display_url)
    return CacheApp(config, server, port, client, probe, telemetry, health, store, metrics)
