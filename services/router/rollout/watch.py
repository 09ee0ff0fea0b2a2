"""Follows every rollout document under `<prefix>rollout/`: a full read, then a prefix watch.

After losing etcd the last documents stay in force; on return the prefix is read again and
handed over whole, so a document deleted meanwhile is dropped too.
"""

from __future__ import annotations

from typing import Callable

from services.common.config import EtcdConfig
from services.common.etcd_watch import KeyWatcher
from services.common.membership import make_client
from services.router.rollout.state import ROLLOUT_PREFIX


class RolloutWatch(KeyWatcher):
    """A KeyWatcher over the whole prefix (its reconnect loop, start and stop are reused)."""

    def __init__(
        self,
        config: EtcdConfig,
        on_snapshot: Callable[[dict[str, bytes]], None],
        on_change: Callable[[str, bytes | None], None],
    ) -> None:
        super().__init__(config, f"{config.prefix}{ROLLOUT_PREFIX}", on_value=lambda _value: None)
        # Every document by model name, after each (re)read of the prefix.
        self._on_snapshot = on_snapshot
        # One model's new document, or None when it was deleted.
        self._on_change = on_change

    def _model(self, key: bytes) -> str:
        return key[len(self.key):].decode()

    async def _follow(self) -> None:
        client = make_client(self.config)
        try:
            await client.connect()
            snapshot = await client.get_prefix(self.key)
            self._on_snapshot({self._model(kv.key): kv.value for kv in snapshot})
            self.synced.set()
            watch = await client.watch_prefix(self.key, start_revision=snapshot.header.revision + 1)
            async for event in watch:
                self._on_change(self._model(event.kv.key), None if event.kind == "DELETE" else event.kv.value)
        finally:
            try:
                await client.close()
            except Exception:  # closing a broken channel may fail; it is gone either way
                pass
