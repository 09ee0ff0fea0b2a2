"""Follows every rollout document under `<prefix>rollout/`: a full read, then a prefix watch.

After losing etcd the last documents stay in force; on return the prefix is read again and
handed over whole, so a document deleted meanwhile is dropped too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from services.common.config import EtcdConfig
from services.common.membership import ETCD_ERRORS, make_client
from services.common.tasks import stop_task
from services.router.rollout.state import ROLLOUT_PREFIX

log = logging.getLogger(__name__)


class RolloutWatch:
    def __init__(
        self,
        config: EtcdConfig,
        on_snapshot: Callable[[dict[str, bytes]], None],
        on_change: Callable[[str, bytes | None], None],
    ) -> None:
        self.config = config
        self.prefix = f"{config.prefix}{ROLLOUT_PREFIX}".encode()
        # Every document by model name, after each (re)read of the prefix.
        self._on_snapshot = on_snapshot
        # One model's new document, or None when it was deleted.
        self._on_change = on_change
        self._task: asyncio.Task | None = None
        self.synced = asyncio.Event()

    def _model(self, key: bytes) -> str:
        return key[len(self.prefix):].decode()

    async def _follow(self) -> None:
        client = make_client(self.config)
        try:
            await client.connect()
            snapshot = await client.get_prefix(self.prefix)
            self._on_snapshot({self._model(kv.key): kv.value for kv in snapshot})
            self.synced.set()
            watch = await client.watch_prefix(self.prefix, start_revision=snapshot.header.revision + 1)
            async for event in watch:
                self._on_change(self._model(event.kv.key), None if event.kind == "DELETE" else event.kv.value)
        finally:
            try:
                await client.close()
            except Exception:  # closing a broken channel may fail; it is gone either way
                pass

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
            except ETCD_ERRORS as exc:
                log.debug("rollout watch lost: %s", exc)
            await asyncio.sleep(self.config.reconnect_backoff_s)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rollout-watch")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
