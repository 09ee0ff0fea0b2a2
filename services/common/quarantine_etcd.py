"""The quarantine in etcd: a prefix watch that keeps a `QuarantineStore` in step, and a
publisher that writes new entries under a lease of their time to live.

The watch reads `<prefix>quarantine/` whole, then follows it; a DELETE (the lease expired, or
an operator lifted the quarantine with `etcdctl del`) drops the entry. While etcd is away the
store keeps what it holds, and the publisher keeps at most `max_pending` entries to write once
etcd is back (an entry that lapses meanwhile is not written).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math

from services.common.config import EtcdConfig
from services.common.etcd_watch import KeyWatcher
from services.common.membership import ETCD_ERRORS, make_client
from services.common.quarantine import (
    QUARANTINE_PREFIX,
    InvalidQuarantineEntry,
    QuarantineEntry,
    QuarantineStore,
    quarantine_key,
)
from services.common.tasks import stop_task

log = logging.getLogger(__name__)


class QuarantineWatch(KeyWatcher):
    """Follows every entry under `<prefix>quarantine/` into `store` (KeyWatcher's reconnect loop)."""

    def __init__(self, config: EtcdConfig, store: QuarantineStore) -> None:
        super().__init__(config, f"{config.prefix}{QUARANTINE_PREFIX}", on_value=lambda _value: None)
        self.store = store

    def _entry(self, raw: bytes) -> QuarantineEntry | None:
        try:
            return QuarantineEntry.from_json(raw)
        except InvalidQuarantineEntry as exc:
            log.warning("ignored a value under %s: %s", self.key.decode(), exc)
            return None

    async def _follow(self) -> None:
        client = make_client(self.config)
        try:
            await client.connect()
            snapshot = await client.get_prefix(self.key)
            self.store.merge(e for e in (self._entry(kv.value) for kv in snapshot) if e is not None)
            self.synced.set()
            watch = await client.watch_prefix(self.key, start_revision=snapshot.header.revision + 1)
            async for event in watch:
                if event.kind == "DELETE":
                    self.store.remove(event.kv.key[len(self.key):].decode())
                    continue
                entry = self._entry(event.kv.value)
                if entry is not None:
                    self.store.add(entry)
        finally:
            try:
                await client.close()
            except Exception:  # closing a broken channel may fail; it is gone either way
                pass


class QuarantinePublisher:
    """Writes entries to etcd, each under its own lease of the entry's remaining time."""

    def __init__(self, config: EtcdConfig, store: QuarantineStore, max_pending: int = 256) -> None:
        self.config = config
        self.store = store
        self._pending: collections.deque[QuarantineEntry] = collections.deque(maxlen=max_pending)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.published = 0

    def publish(self, entry: QuarantineEntry) -> None:
        """Queues `entry` for etcd; when the queue is full the oldest waiting entry is dropped
        (it stays quarantined on this router)."""
        if len(self._pending) == self._pending.maxlen:
            log.warning("quarantine publisher: %d entries wait for etcd; dropping the oldest", len(self._pending))
        self._pending.append(entry)
        self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="quarantine-publisher")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _run(self) -> None:
        backoff = self.config.reconnect_backoff_s
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                entry = self._pending[0]
                try:
                    await self._write(entry)
                except ETCD_ERRORS as exc:
                    log.warning("cannot write quarantine entry %s to etcd yet: %s", entry.fingerprint[:16], exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                backoff = self.config.reconnect_backoff_s
                if self._pending and self._pending[0] is entry:
                    self._pending.popleft()

    async def _write(self, entry: QuarantineEntry) -> None:
        ttl = math.ceil(self.store.remaining_s(entry))
        if ttl <= 0:
            return  # lapsed while it waited
        client = make_client(self.config)
        try:
            async with asyncio.timeout(self.config.timeout_s):
                await client.connect()
                lease = await client.lease(max(2, ttl))
                await client.put(quarantine_key(self.config.prefix, entry.fingerprint).encode(), entry.to_json(),
                                 lease=lease)
        finally:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - the write's own outcome is what counts
                pass
        self.published += 1
