"""Follows one etcd key (e.g. live config): a read, then a watch; resyncs after etcd loss.

The callback gets the key's value (None when deleted) on every change. While etcd is away
the last value stays in force; on return the key is read again, so no change is missed.
The reads, the watch and the reconnects are the session's (`etcd_session.watch_prefix`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from services.common.config import EtcdConfig
from services.common.etcd_session import Change, EtcdSession

log = logging.getLogger(__name__)


class KeyWatcher:
    def __init__(
        self, config: EtcdConfig, key: str, on_value: Callable[[bytes | None], None], session: EtcdSession | None = None
    ) -> None:
        self.config = config
        self.key = key.encode()
        self._on_value = on_value
        # A session of its own unless the owner shares one (then the owner closes it).
        self._owned = session is None
        self.session = session or EtcdSession(config)
        self._watch = self.session.watch_prefix(self.key, self._on_sync, self._on_change, name=f"watch-{key}")
        self.synced = asyncio.Event()

    def _deliver(self, value: bytes | None) -> None:
        try:
            self._on_value(value)
        except Exception:  # a bad value must not kill the watch; the callback logs why
            log.exception("rejected value of %s", self.key.decode())

    def _on_sync(self, snapshot: dict[bytes, Change], _changes: list[Change]) -> None:
        # The prefix read also holds longer keys that start with this one: only this key counts.
        found = snapshot.get(self.key)
        self._deliver(None if found is None else found.value)
        self.synced.set()

    def _on_change(self, change: Change) -> None:
        if change.key == self.key:
            self._deliver(change.value)

    async def start(self) -> None:
        await self._watch.start()

    async def stop(self) -> None:
        await self._watch.stop()
        if self._owned:
            await self.session.close()
