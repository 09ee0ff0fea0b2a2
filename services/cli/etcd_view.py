"""Reads the worker membership straight from etcd, for `ballast status` and the launcher."""

from __future__ import annotations

import asyncio

from services.common.config import EtcdConfig
from services.common.membership import WorkerRecord, make_client, workers_prefix


async def list_workers(config: EtcdConfig, with_lease_ttl: bool = False) -> list[tuple[WorkerRecord, int | None]]:
    """Every registered worker, with its lease's remaining seconds when asked."""
    client = make_client(config)
    try:
        await asyncio.wait_for(client.connect(), config.timeout_s)
        result = await asyncio.wait_for(client.get_prefix(workers_prefix(config).encode()), config.timeout_s)
        rows = []
        for kv in result:
            record = WorkerRecord.from_json(kv.value, kv.lease)
            ttl = None
            if with_lease_ttl and kv.lease:
                info = await asyncio.wait_for(client.get_lease_info(kv.lease, keys=False), config.timeout_s)
                ttl = info.TTL
            rows.append((record, ttl))
        return sorted(rows, key=lambda row: row[0].id)
    finally:
        await client.close()
