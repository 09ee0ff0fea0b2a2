"""What `ballast status` shows of poison containment: the fingerprints quarantined now (from
etcd, as every router follows them) and the latest tickets the backfill parked (from Redis)."""

from __future__ import annotations

import asyncio
import time

from services.backfill.parked import ParkedTicket, parked_key, read_parked
from services.common.config import EtcdConfig, RedisConfig
from services.common.etcd_session import EtcdSession
from services.common.quarantine import QUARANTINE_PREFIX, InvalidQuarantineEntry, QuarantineEntry

# Lines of each list at most: status is a glance, etcdctl and the dead-letter topic hold the rest.
SHOWN = 10
DEFAULT_BACKFILL_PREFIX = "ballast:backfill:"


async def quarantined(config: EtcdConfig) -> list[QuarantineEntry]:
    async with EtcdSession(config) as session:
        await asyncio.wait_for(session.client(), session.call_timeout_s)
        result = await asyncio.wait_for(
            session.get_prefix(f"{config.prefix}{QUARANTINE_PREFIX}".encode()), config.timeout_s
        )
        entries = []
        for kv in result:
            try:
                entries.append(QuarantineEntry.from_json(kv.value))
            except InvalidQuarantineEntry:
                continue
        return sorted(entries, key=lambda e: e.since, reverse=True)


async def parked(config: RedisConfig, redis_prefix: str, count: int = SHOWN) -> list[ParkedTicket]:
    from services.common.redis_client import make_client as redis_client

    client = redis_client(config, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s)
    try:
        return read_parked(await client.lrange(parked_key(redis_prefix), 0, count - 1))
    finally:
        await client.aclose()


def describe(entries: list[QuarantineEntry], tickets: list[ParkedTicket] | None, now: float | None = None) -> list[str]:
    now = time.time() if now is None else now
    lines = [f"quarantine: {len(entries)} fingerprint(s) refused"]
    for e in entries[:SHOWN]:
        lines.append(
            f"  {e.fingerprint[:16]}  tenant {e.tenant}  {e.reason}, {e.workers_lost} workers lost, "
            f"{now - e.since:.0f}s ago, {max(0.0, e.expires_at() - now):.0f}s left"
        )
    if tickets is None:
        lines.append("backfill parked: (redis not readable)")
        return lines
    lines.append(f"backfill parked (latest {len(tickets)}):" if tickets else "backfill parked: none")
    for t in tickets:
        lines.append(f"  {t.ticket}  tenant {t.tenant or '-'}  {t.cause}, {t.attempts} attempts, {now - t.at:.0f}s ago")
    return lines


def poison_lines(config) -> list[str]:
    """The status lines of a whole config (etcd, redis, backfill prefix); errors say so in a line."""
    try:
        entries = asyncio.run(quarantined(config.etcd))
    except Exception as exc:  # noqa: BLE001 - status reports what it cannot read
        return [f"quarantine: cannot read etcd ({exc})"]
    prefix = getattr(config.backfill, "redis_prefix", DEFAULT_BACKFILL_PREFIX)
    try:
        tickets = asyncio.run(parked(config.redis, prefix))
    except Exception:  # noqa: BLE001 - Redis away: the quarantine is still worth showing
        tickets = None
    return describe(entries, tickets)
