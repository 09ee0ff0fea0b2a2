"""A leader lock over an etcd lease: one holder at a time, however many candidates campaign.

A candidate campaigns by creating `<prefix>leader/<name>` under its own lease, in a
transaction that succeeds only while the key does not exist. The holder keeps its lease
alive and steps down the moment a refresh fails, the lease is gone, or the key changes or
disappears (it watches it), so it stops acting before anyone else can start. The others
watch the key and campaign again as soon as it is deleted: at once when the holder resigns,
at the latest one TTL after it died, when etcd expires its lease.

Leadership is advisory between the checks: a holder cut off from etcd may act for up to one
refresh interval plus one call deadline after its lease expired. Whatever it acts on must
therefore be idempotent and absolute (desired counts, not "add one").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aetcd

from services.common.config import EtcdConfig
from services.common.membership import ETCD_ERRORS, close_client, make_client
from services.common.tasks import stop_task

log = logging.getLogger(__name__)


def leader_key(config: EtcdConfig, name: str) -> str:
    return f"{config.prefix}leader/{name}"


class LeaderLock:
    """Campaigns for `name` as `identity` until stopped; `is_leader` says whether it holds it."""

    def __init__(
        self,
        config: EtcdConfig,
        name: str,
        identity: str,
        ttl_s: int = 5,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        if ttl_s < 2:
            raise ValueError("ttl_s must be >= 2: a shorter lease cannot be kept alive reliably")
        self.config = config
        self.key = leader_key(config, name).encode()
        self.identity = identity
        self.ttl_s = ttl_s
        self._on_change = on_change
        self._leader = asyncio.Event()
        self._lease: aetcd.leases.Lease | None = None
        self._task: asyncio.Task | None = None
        self.terms = 0
        """How many times this candidate has won (a new term after every loss)."""

    @property
    def is_leader(self) -> bool:
        return self._leader.is_set()

    @property
    def lease_id(self) -> int | None:
        """The lease holding the key while leader (to revoke it in tests and drills)."""
        return self._lease.id if self._lease is not None and self.is_leader else None

    async def wait_leader(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._leader.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_follower(self, timeout: float) -> bool:
        """Waits until this candidate does not hold the lock; False on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.is_leader:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def _set_leader(self, leader: bool) -> None:
        if leader == self.is_leader:
            return
        if leader:
            self.terms += 1
            self._leader.set()
            log.info("%s is now leader of %s (term %d)", self.identity, self.key.decode(), self.terms)
        else:
            self._leader.clear()
            log.info("%s is no longer leader of %s", self.identity, self.key.decode())
        if self._on_change is not None:
            self._on_change(leader)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"leader-{self.key.decode()}")

    async def stop(self) -> None:
        """Stops campaigning and resigns: the key goes at once, so a follower takes over
        without waiting for the TTL."""
        lease = self._lease if self.is_leader else None
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        self._set_leader(False)
        if lease is not None:
            client = make_client(self.config)
            try:
                await client.connect()
                await asyncio.wait_for(client.revoke_lease(lease.id), self.config.timeout_s)
            except ETCD_ERRORS as exc:
                log.warning("could not resign (the lease will expire): %s", exc)
            finally:
                await close_client(client)
        self._lease = None

    async def holder(self) -> str | None:
        """Who holds the lock now, read from etcd (None: nobody)."""
        client = make_client(self.config)
        try:
            await client.connect()
            result = await client.get(self.key)
            return None if result is None else result.value.decode()
        finally:
            await close_client(client)

    async def _run(self) -> None:
        backoff = self.config.reconnect_backoff_s
        while True:
            client = make_client(self.config)
            try:
                await client.connect()
                await self._campaign(client)
            except ETCD_ERRORS as exc:
                log.warning("leader lock %s: etcd unreachable, campaigning again: %s", self.key.decode(), exc)
            finally:
                self._set_leader(False)
                await close_client(client)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _campaign(self, client: aetcd.Client) -> None:
        txn = client.transactions
        while True:
            lease = await client.lease(self.ttl_s)
            won, responses = await client.transaction(
                compare=[txn.create(self.key) == 0],
                success=[txn.put(self.key, self.identity.encode(), lease=lease)],
                failure=[txn.get(self.key)],
            )
            if won:
                self._lease = lease
                self._set_leader(True)
                try:
                    await self._hold(client, lease, responses[0].response_put.header.revision)
                finally:
                    self._set_leader(False)
                    self._lease = None
                # A holder that lost its lease is the likeliest to be in trouble (slow, cut
                # off): give the others one TTL to take over before campaigning again.
                await asyncio.sleep(self.ttl_s)
                continue
            # Not ours: the lease we took for the attempt is of no use while we wait.
            await client.revoke_lease(lease.id)
            held = responses[0]
            revision = held[0][1].mod_revision if held else 0
            await self._wait_vacant(client, revision)

    async def _wait_vacant(self, client: aetcd.Client, revision: int) -> None:
        """Returns once the key has been deleted after `revision` (or after a TTL, to re-check)."""
        if revision == 0:
            return
        watch = await client.watch(self.key, start_revision=revision + 1)

        async def deleted() -> None:
            async for event in watch:
                if event.kind == "DELETE":
                    return

        try:
            # The bound makes a lost watch cost one TTL of delay, never a stuck follower.
            async with asyncio.timeout(self.ttl_s * 2):
                await deleted()
        except TimeoutError:
            pass
        finally:
            await watch.cancel()

    async def _hold(self, client: aetcd.Client, lease: aetcd.leases.Lease, revision: int) -> None:
        """Keeps the lease alive; returns when leadership is lost."""
        watch = await client.watch(self.key, start_revision=revision + 1)
        lost = asyncio.Event()

        async def follow() -> None:
            async for event in watch:
                if event.kind == "DELETE" or event.kv.value != self.identity.encode():
                    break
            lost.set()

        follower = asyncio.create_task(follow())
        interval = self.ttl_s / 3
        try:
            while not lost.is_set():
                try:
                    # asyncio.timeout, not wait_for: wait_for can swallow the cancel that stops us.
                    async with asyncio.timeout(interval):
                        await lost.wait()
                    break
                except TimeoutError:
                    pass
                async with asyncio.timeout(min(self.config.timeout_s, interval)):
                    reply = await lease.refresh()
                if reply is None or reply.TTL <= 0:
                    log.warning("leader lease of %s expired", self.key.decode())
                    break
        finally:
            await stop_task(follower)
            try:
                await watch.cancel()
            except ETCD_ERRORS:
                pass
