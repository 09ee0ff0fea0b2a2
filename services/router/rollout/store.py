"""Reads and writes rollout documents in etcd; every write is a compare-and-swap.

A write names the mod revision it read (0: the key must not exist yet) and succeeds only
if the key is unchanged, so two routers that both see a breach, or an operator and a
router acting at once, cannot overwrite each other: the loser re-reads and finds the
decision already made. The store works over an `EtcdSession` (or a bare aetcd client).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from services.common.config import EtcdConfig
from services.common.etcd_session import EtcdSession
from services.router.rollout.state import ROLLOUT_PREFIX, Rollout, load_rollout, rollout_key


T = TypeVar("T")


@dataclass(frozen=True)
class Stored:
    """A rollout as read from etcd, with the revision a compare-and-swap must match."""

    rollout: Rollout
    mod_revision: int


class RolloutStore:
    """Rollout documents under `<prefix>rollout/`, over one session (or aetcd client)."""

    def __init__(self, client: Any, config: EtcdConfig) -> None:
        self.client = client
        self.config = config

    def key(self, model: str) -> bytes:
        return rollout_key(self.config.prefix, model).encode()

    async def read(self, model: str) -> Stored | None:
        """The model's rollout, or None; a stored document that is invalid raises RolloutError."""
        got = await asyncio.wait_for(self.client.get(self.key(model)), self.config.timeout_s)
        if got is None:
            return None
        return Stored(load_rollout(got.value, model), got.mod_revision)

    async def read_all(self) -> dict[str, bytes]:
        """Every stored document by model name, unparsed (for listings that show bad ones too)."""
        prefix = f"{self.config.prefix}{ROLLOUT_PREFIX}".encode()
        result = await asyncio.wait_for(self.client.get_prefix(prefix), self.config.timeout_s)
        return {kv.key[len(prefix) :].decode(): kv.value for kv in result}

    async def swap(self, rollout: Rollout, mod_revision: int) -> bool:
        """Writes the document if the key still has `mod_revision` (0: absent); False if not."""
        key = self.key(rollout.model)
        txn = self.client.transactions
        succeeded, _responses = await asyncio.wait_for(
            self.client.transaction(
                compare=[txn.mod(key) == mod_revision],
                success=[txn.put(key, rollout.to_json())],
                failure=[],
            ),
            self.config.timeout_s,
        )
        return bool(succeeded)


async def store_over(session: EtcdSession, config: EtcdConfig) -> RolloutStore:
    """A store over `session`, connected first (finding a live member), so that each call's
    deadline is the call's alone."""
    await session.client()
    return RolloutStore(session, config)


async def with_store(config: EtcdConfig, action: Callable[[RolloutStore], Awaitable[T]]) -> T:
    """Runs `action` on a store over a session of its own: for a tool run once (`ballast
    rollout`); a router's writes go through its own session (`store_over`)."""
    async with EtcdSession(config) as session:
        return await action(await store_over(session, config))
