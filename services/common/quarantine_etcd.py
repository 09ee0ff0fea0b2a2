"""The quarantine in etcd: a prefix watch that keeps a `QuarantineStore` in step, and a
publisher that writes new entries under a lease of their time to live.

The watch reads `<prefix>quarantine/` whole, then follows it; a DELETE (the lease expired, or
an operator lifted the quarantine with `etcdctl del`) drops the entry. While etcd is away the
store keeps what it holds, and the publisher keeps at most `max_pending` entries to write once
etcd is back (an entry that lapses meanwhile is not written). Both work over the process's
`EtcdSession` when given one (its owner closes it), else over one of their own.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math

from services.common.config import EtcdConfig
from services.common.etcd_session import ETCD_ERRORS, Change, EtcdSession, next_wait, reconnect_backoff
from services.common.quarantine import (
    QUARANTINE_PREFIX,
    InvalidQuarantineEntry,
    QuarantineEntry,
    QuarantineStore,
    quarantine_key,
)
from services.common.tasks import stop_task

log = logging.getLogger(__name__)


class QuarantineWatch:
    """Follows every entry under `<prefix>quarantine/` into `store` (the session's prefix watch)."""

    def __init__(self, config: EtcdConfig, store: QuarantineStore, session: EtcdSession | None = None) -> None:
        self.config = config
        self.key = f"{config.prefix}{QUARANTINE_PREFIX}".encode()
        self.store = store
        # The process's session when given (its owner closes it), else one of its own.
        self._owns_session = session is None
        self.session = session or EtcdSession(config)
        self._watch = self.session.watch_prefix(self.key, self._on_sync, self._on_change, name="quarantine-watch")
        self.synced = asyncio.Event()

    def _entry(self, raw: bytes) -> QuarantineEntry | None:
        try:
            return QuarantineEntry.from_json(raw)
        except InvalidQuarantineEntry as exc:
            log.warning("ignored a value under %s: %s", self.key.decode(), exc)
            return None

    def _on_sync(self, snapshot: dict[bytes, Change], _changes: list[Change]) -> None:
        # A merge, not a replacement: entries written here while etcd was away are kept.
        self.store.merge(
            e for e in (self._entry(c.value) for c in snapshot.values() if c.value is not None) if e is not None
        )
        self.synced.set()

    def _on_change(self, change: Change) -> None:
        if change.value is None:
            self.store.remove(change.key[len(self.key) :].decode())
            return
        entry = self._entry(change.value)
        if entry is not None:
            self.store.add(entry)

    async def start(self) -> None:
        await self._watch.start()

    async def stop(self) -> None:
        await self._watch.stop()
        if self._owns_session:
            await self.session.close()


class QuarantinePublisher:
    """Writes entries to etcd, each under its own lease of the entry's remaining time."""

    def __init__(
        self, config: EtcdConfig, store: QuarantineStore, max_pending: int = 256, session: EtcdSession | None = None
    ) -> None:
        self.config = config
        self.store = store
        self._pending: collections.deque[QuarantineEntry] = collections.deque(maxlen=max_pending)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # The process's session when given (its owner closes it), else one of its own.
        self._owns_session = session is None
        self.session = session or EtcdSession(config)
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
        if self._owns_session:
            await self.session.close()

    async def _run(self) -> None:
        backoff = reconnect_backoff(self.config)
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                entry = self._pending[0]
                try:
                    await self._write(entry)
                except ETCD_ERRORS as exc:
                    log.warning("cannot write quarantine entry %s to etcd yet: %s", entry.fingerprint[:16], exc)
                    await asyncio.sleep(next_wait(backoff))
                    continue
                backoff.streak = 0
                if self._pending and self._pending[0] is entry:
                    self._pending.popleft()

    async def _write(self, entry: QuarantineEntry) -> None:
        ttl = math.ceil(self.store.remaining_s(entry))
        if ttl <= 0:
            return  # lapsed while it waited
        key = quarantine_key(self.config.prefix, entry.fingerprint).encode()
        # Each entry under a lease of its own remaining time: etcd drops it when it lapses.
        await self.session.put(key, entry.to_json(), lease=await self.session.grant(max(2, ttl)))
        self.published += 1
