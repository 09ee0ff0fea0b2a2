"""Redis clients for the services: one server (or a primary with replicas) or a Redis Cluster.

`redis.cluster` in the config picks redis-py's cluster client, which learns the slot map from
the node in the URL, sends each command to the master of its key's slot and follows slot moves
and failovers. Callers keep to what both clients do alike: single-key commands, pipelines
without transactions, scripts over one slot. What differs (server statistics summed over the
masters, the cluster's own health) is here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import redis.asyncio as redis_asyncio
from redis.asyncio.cluster import RedisCluster
from redis import exceptions as redis_errors

from services.common.config import RedisConfig

AnyRedis = Union[redis_asyncio.Redis, RedisCluster]

# Failures that mean "Redis cannot serve this now" on either client: a lost connection, a
# slot without a master during a failover, a slot moving. None of them is the caller's fault.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    redis_errors.ClusterError,
    redis_errors.RedisClusterException,
    redis_errors.TryAgainError,
    OSError,
)


def make_client(config: RedisConfig, **options: Any) -> AnyRedis:
    """A client for `config` (URL, ACL user, TLS files; cluster or not); `options` are
    redis-py's (timeouts, retry, read size)."""
    kwargs = {**config.connection_kwargs(), **options}
    if config.cluster:
        return RedisCluster.from_url(config.effective_url, **kwargs)
    return redis_asyncio.Redis.from_url(config.effective_url, **kwargs)


def is_cluster(client: AnyRedis) -> bool:
    return isinstance(client, RedisCluster)


async def ping(client: AnyRedis) -> None:
    """PING the server, or every master of a cluster (one that does not answer fails it)."""
    if is_cluster(client):
        await client.ping(target_nodes=RedisCluster.PRIMARIES)
    else:
        await client.ping()


async def open_pubsub(client: AnyRedis, **options: Any):
    """A pub/sub object; on a cluster, after the client has learned the slot map (redis-py's
    cluster pub/sub picks its node from the map and fails on an empty one)."""
    if is_cluster(client):
        await client.initialize()
    return client.pubsub(**options)


async def info_per_master(client: AnyRedis, section: str) -> list[dict]:
    """INFO `section` of the server, or of every master of a cluster."""
    if not is_cluster(client):
        return [await client.info(section)]
    replies = await client.info(section, target_nodes=RedisCluster.PRIMARIES)
    # One master answers with its dict; several with {node name: dict}.
    if replies and all(isinstance(value, dict) for value in replies.values()):
        return list(replies.values())
    return [replies]


async def count_keys(client: AnyRedis) -> int:
    """Keys in the server, or in all masters of a cluster together."""
    if not is_cluster(client):
        return int(await client.dbsize())
    replies = await client.dbsize(target_nodes=RedisCluster.PRIMARIES)
    return int(sum(replies.values()) if isinstance(replies, dict) else replies)


@dataclass(frozen=True)
class ClusterHealth:
    """CLUSTER INFO as one reachable node sees it, and how many masters answer us."""

    state_ok: bool
    slots_ok: int
    slots_assigned: int
    known_nodes: int
    masters: int
    masters_reachable: int


async def cluster_health(client: RedisCluster) -> ClusterHealth:
    masters = client.get_primaries()
    reachable = 0
    info: dict = {}
    for node in masters:
        try:
            info = await client.cluster_info(target_nodes=node)
            reachable += 1
        except UNAVAILABLE_ERRORS:
            continue
    return ClusterHealth(
        state_ok=info.get("cluster_state") == "ok",
        slots_ok=int(info.get("cluster_slots_ok", 0)),
        slots_assigned=int(info.get("cluster_slots_assigned", 0)),
        known_nodes=int(info.get("cluster_known_nodes", 0)),
        masters=len(masters),
        masters_reachable=reachable,
    )
