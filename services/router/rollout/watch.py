"""Follows every rollout document under `<prefix>rollout/`: a full read, then a prefix watch.

After losing etcd the last documents stay in force; on return the prefix is read again and
handed over whole, so a document deleted meanwhile is dropped too. The watch is the router's
`EtcdSession`'s when given one (the router closes it), else one of its own session's.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from services.common.config import EtcdConfig
from services.common.etcd_session import Change, EtcdSession
from services.router.rollout.state import ROLLOUT_PREFIX


class RolloutWatch:
    """The session's prefix watch over `<prefix>rollout/`, handed over by model name."""

    def __init__(
        self,
        config: EtcdConfig,
        on_snapshot: Callable[[dict[str, bytes]], None],
        on_change: Callable[[str, bytes | None], None],
        session: EtcdSession | None = None,
    ) -> None:
        self.config = config
        self.key = f"{config.prefix}{ROLLOUT_PREFIX}".encode()
        # Every document by model name, after each (re)read of the prefix.
        self._on_snapshot = on_snapshot
        # One model's new document, or None when it was deleted.
        self._on_change = on_change
        self._owns_session = session is None
        self.session = session or EtcdSession(config)
        self._watch = self.session.watch_prefix(self.key, self._synced, self._changed, name="rollout-watch")
        self.synced = asyncio.Event()

    def _model(self, key: bytes) -> str:
        return key[len(self.key) :].decode()

    def _synced(self, snapshot: dict[bytes, Change], _changes: list[Change]) -> None:
        self._on_snapshot({self._model(key): c.value for key, c in snapshot.items() if c.value is not None})
        self.synced.set()

    def _changed(self, change: Change) -> None:
        self._on_change(self._model(change.key), change.value)

    async def start(self) -> None:
        await self._watch.start()

    async def stop(self) -> None:
        await self._watch.stop()
        if self._owns_session:
            await self.session.close()
