"""Follows one etcd key (e.g. live config): a read, then a watch; resyncs after etcd loss.

The callback gets the key's value (None when deleted) on every change. While etcd is away
the last value stays in force; on return the key is read again, so no change is missed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from services.common.config import EtcdConfig
from services.common.membership import ETCD_ERRORS, make_client
from services.common.tasks import stop_task

log = logging.getLogger(__name__)


class KeyWatcher:
    def __init__(self, config: EtcdConfig, key: str, on_value: Callable[[bytes | None], None]) -> None:
        self.config = config
        self.key = key.encode()
        self._on_value = on_value
        self._task: asyncio.Task | None = None
        self.synced = asyncio.Event()

    def _deliver(self, value: bytes | None) -> None:
        try:
            self._on_value(value)
        except Exception:  # a bad value must not kill the watch; the callback logs why
            log.exception("rejected value of %s", self.key.decode())

    async def _follow(self) -> None:
        client = make_client(self.config)
        try:
            await client.connect()
            # One read gives both the value and the revision to watch from: nothing slips between.
            result = await client.get_prefix(self.key)
            self._deliver(next((kv.value for kv in result if kv.key == self.key), None))
            self.synced.set()
            watch = await client.watch(self.key, start_revision=result.header.revision + 1)
            async for event in watch:
                self._deliver(None if event.kind == "DELETE" else event.kv.value)
        finally:
            try:
                await client.close()
            except Exception:
                pass

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
            except ETCD_ERRORS as exc:
                log.debug("watch of %s lost: %s", self.key.decode(), exc)
            await asyncio.sleep(self.config.reconnect_backoff_s)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"watch-{self.key.decode()}")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
