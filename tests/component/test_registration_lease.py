"""A worker whose etcd client was reset after a failed call keeps its lease when etcd still
holds it: routers keep seeing the same incarnation (no failover of its streams, no second set
of free slots); only a lease that really expired is replaced."""

from __future__ import annotations

import asyncio
import uuid

from services.cli.etcd_view import list_workers
from services.common.config import EtcdConfig
from services.common.membership import WorkerRecord, WorkerRegistration
from services.common.telemetry import DependencyStatus


def etcd_config(etcd_server) -> EtcdConfig:
    return EtcdConfig(host=etcd_server.host, port=etcd_server.port, prefix=f"/reg-{uuid.uuid4().hex[:8]}/",
                      lease_ttl_s=10, heartbeat_s=5.0)  # no heartbeat of its own during the test


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


async def test_a_reset_client_keeps_a_live_lease_and_replaces_an_expired_one(etcd_server):
    config = etcd_config(etcd_server)
    record = WorkerRecord(id="w-lease", address="127.0.0.1:1", model="tiny", model_version="v1")
    registration = WorkerRegistration(config, lambda: record, DependencyStatus())
    await registration.start()
    try:
        await asyncio.wait_for(registration.registered.wait(), 10)
        first = await lease_of(config, "w-lease")
        assert first

        await registration._reset_client()  # what a timed-out etcd call does
        assert await published_again(registration, config, "w-lease") == first

        # The lease really gone (revoked here, as an expiry would): a new one is taken.
        await registration._lease.revoke()
        await registration._reset_client()
        replaced = await published_again(registration, config, "w-lease")
        assert replaced and replaced != first
    finally:
        await registration.stop()
