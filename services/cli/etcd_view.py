"""Reads the worker membership straight from etcd, for `ballast status` and the launcher."""

from __future__ import annotations

import asyncio

from services.common.config import EtcdConfig
from services.common.etcd_session import EtcdSession
from services.common.membership import WorkerRecord, workers_prefix


async def list_workers(config: EtcdConfig, with_lease_ttl: bool = False) -> list[tuple[WorkerRecord, int | None]]:
    """Every registered worker, with its lease's remaining seconds when asked."""
    async with EtcdSession(config) as session:
        await asyncio.wait_for(session.client(), session.call_timeout_s)
        result = await asyncio.wait_for(session.get_prefix(workers_prefix(config).encode()), config.timeout_s)
        rows = []
        for kv in result:
            record = WorkerRecord.from_json(kv.value, kv.lease)
            ttl = None
            if with_lease_ttl and kv.lease:
                ttl = await asyncio.wait_for(session.lease_ttl(kv.lease), config.timeout_s)
            rows.append((record, ttl))
        return sorted(rows, key=lambda row: row[0].id)
