"""A worker whose etcd client was reset after a failed call keeps its lease when etcd still
holds it: routers keep seeing the same incarnation (no failover of its streams, no second set
of free slots); only a lease that really expired is replaced."""

from __future__ import annotations

import asyncio
import uuid

from services.cli.etcd_view import list_workers
from services.common.config import EtcdConfig
from services.common.membership import WorkerRecord, WorkerRegistration, make_client, worker_key
from services.common.telemetry import DependencyStatus


def etcd_config(etcd_server) -> EtcdConfig:
    return EtcdConfig(
        host=etcd_server.host,
        port=etcd_server.port,
        prefix=f"/reg-{uuid.uuid4().hex[:8]}/",
        lease_ttl_s=10,
        heartbeat_s=5.0,
    )  # no heartbeat of its own during the test


async def lease_of(config: EtcdConfig, worker_id: str) -> int | None:
    for record, _ in await list_workers(config):
        if record.id == worker_id:
            return record.lease_id
    return None


async def published_again(registration: WorkerRegistration, config: EtcdConfig, worker_id: str) -> int | None:
    registration.registered.clear()
    registration.publish_now()
    await asyncio.wait_for(registration.registered.wait(), 10)
    return await lease_of(config, worker_id)


async def call_timed_out(registration: WorkerRegistration) -> None:
    """What a timed-out etcd call does: the session drops its client, and the registration
    writes its record again at the next heartbeat."""
    await registration.session.reset()
    registration._write_again()


async def test_a_reset_client_keeps_a_live_lease_and_replaces_an_expired_one(etcd_server):
    config = etcd_config(etcd_server)
    record = WorkerRecord(id="w-lease", address="127.0.0.1:1", model="tiny", model_version="v1")
    registration = WorkerRegistration(config, lambda: record, DependencyStatus())
    await registration.start()
    try:
        await asyncio.wait_for(registration.registered.wait(), 10)
        first = await lease_of(config, "w-lease")
        assert first

        await call_timed_out(registration)
        assert await published_again(registration, config, "w-lease") == first

        # The lease really gone (revoked here, as an expiry would): a new one is taken.
        await registration._lease.revoke()
        await call_timed_out(registration)
        replaced = await published_again(registration, config, "w-lease")
        assert replaced and replaced != first
    finally:
        await registration.stop()


async def record_revision(config: EtcdConfig, worker_id: str) -> int | None:
    """The etcd revision that last wrote the worker's record (None: no record)."""
    client = make_client(config)
    try:
        await client.connect()
        got = await client.get(worker_key(config, worker_id).encode())
        return None if got is None else got.mod_revision
    finally:
        await client.close()


async def written_again(config: EtcdConfig, worker_id: str, since: int | None, within_s: float = 10) -> None:
    """Returns once the worker's record was written after revision `since`; fails after `within_s`."""
    deadline = asyncio.get_running_loop().time() + within_s
    while (await record_revision(config, worker_id)) == since:
        assert asyncio.get_running_loop().time() < deadline, f"{worker_id}'s record was not written again"
        await asyncio.sleep(0.05)


async def test_an_unchanged_record_is_not_rewritten_but_stays_alive_and_a_change_goes_out(etcd_server):
    """Every write wakes every router's watch: an idle worker only refreshes its lease."""
    config = EtcdConfig(
        host=etcd_server.host,
        port=etcd_server.port,
        prefix=f"/reg-{uuid.uuid4().hex[:8]}/",
        lease_ttl_s=2,
        heartbeat_s=0.2,
        record_refresh_s=60,
    )
    record = WorkerRecord(id="w-quiet", address="127.0.0.1:1", model="tiny", model_version="v1")
    registration = WorkerRegistration(config, lambda: record, DependencyStatus())
    await registration.start()
    try:
        await asyncio.wait_for(registration.registered.wait(), 10)
        written = await record_revision(config, "w-quiet")
        assert written is not None
        # Past the lease's TTL with a heartbeat every 0.2 s: alive, and not written again.
        await asyncio.sleep(3 * config.lease_ttl_s / 2)
        assert await record_revision(config, "w-quiet") == written

        record.in_flight = 2
        await written_again(config, "w-quiet", written)
        ((published, _),) = [row for row in await list_workers(config) if row[0].id == "w-quiet"]
        assert published.in_flight == 2
    finally:
        await registration.stop()


async def test_an_unchanged_record_is_written_again_after_record_refresh_s(etcd_server):
    config = EtcdConfig(
        host=etcd_server.host,
        port=etcd_server.port,
        prefix=f"/reg-{uuid.uuid4().hex[:8]}/",
        lease_ttl_s=5,
        heartbeat_s=0.2,
        record_refresh_s=0.5,
    )
    record = WorkerRecord(id="w-refresh", address="127.0.0.1:1", model="tiny", model_version="v1")
    registration = WorkerRegistration(config, lambda: record, DependencyStatus())
    await registration.start()
    try:
        await asyncio.wait_for(registration.registered.wait(), 10)
        written = await record_revision(config, "w-refresh")
        await written_again(config, "w-refresh", written)
    finally:
        await registration.stop()
