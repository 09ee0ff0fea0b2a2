"""A leader lock over an etcd lease: one holder at a time, however many candidates campaign.

A candidate campaigns by creating `<prefix>leader/<name>` under its own lease, in a
transaction that succeeds only while the key does not exist. The holder keeps its lease
alive and steps down the moment a refresh fails, the lease is gone, or the key changes or
disappears (it watches it), so it stops acting before anyone else can start. The others
watch the key and campaign again as soon as it is deleted: at once when the holder resigns,
at the latest one TTL after it died, when etcd expires its lease.

Leadership is advisory between the checks: a holder cut off from etcd may act for up to one
refresh interval plus one call deadline after its lease expired. Whatever it acts on must
therefore be idempotent and absolute (desired counts, not "add one"). Connections,
reconnects and the lease calls are an `EtcdSession`'s: the process's, shared with its other
parts (a lock used alone builds its own). The session's client may be dropped by any of them,
which ends the holder's watch without a word about the key: the holder reads the key and
watches it again, and only the key or its lease decide that the term is over.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from services.common.config import EtcdConfig
from services.common.etcd_session import ETCD_ERRORS, EtcdSession, cancel_watch, next_wait, reconnect_backoff
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
        session: EtcdSession | None = None,
    ) -> None:
        if ttl_s < 2:
            raise ValueError("ttl_s must be >= 2: a shorter lease cannot be kept alive reliably")
        self.config = config
        self.key = leader_key(config, name).encode()
        self.identity = identity
        self.ttl_s = ttl_s
        self._on_change = on_change
        self._leader = asyncio.Event()
        # The process's session when given (its owner closes it), else one of its own.
        self._owns_session = session is None
        self.session = session or EtcdSession(config)
        # The lease holding the key while leader.
        self._lease: int | None = None
        self._task: asyncio.Task | None = None
        self.terms = 0
        """How many times this candidate has won (a new term after every loss)."""

    @property
    def is_leader(self) -> bool:
        return self._leader.is_set()

    @property
    def lease_id(self) -> int | None:
        """The lease holding the key while leader (to revoke it in tests and drills)."""
        return self._lease if self._lease is not None and self.is_leader else None

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
            await self.session.revoke(lease)
        self._lease = None
        if self._owns_session:
            await self.session.close()

    async def holder(self) -> str | None:
        """Who holds the lock now, read from etcd (None: nobody). A view for tools and tests, on
        a session of its own: it may run on another event loop than the lock's."""
        async with EtcdSession(self.config) as session:
            result = await session.get(self.key)
            return None if result is None else result.value.decode()

    async def _run(self) -> None:
        backoff = reconnect_backoff(self.config)
        while True:
            try:
                await self._campaign()
            except ETCD_ERRORS as exc:
                # The failed call dropped its client already (the session's calls do, a deadline's
                # cut too); dropping the client again here could drop a newer one that the
                # session's other users just connected.
                log.warning("leader lock %s: etcd unreachable, campaigning again: %s", self.key.decode(), exc)
            finally:
                self._set_leader(False)
            if self.terms:
                backoff.streak = 0  # a term was won since the last loss: etcd works again
            await asyncio.sleep(next_wait(backoff))

    async def _campaign(self) -> None:
        session = self.session
        txn = session.transactions
        while True:
            lease = await session.grant(self.ttl_s)
            won, responses = await session.transaction(
                compare=[txn.create(self.key) == 0],
                success=[txn.put(self.key, self.identity.encode(), lease=lease)],
                failure=[txn.get(self.key)],
            )
            if won:
                self._lease = lease
                self._set_leader(True)
                try:
                    await self._hold(lease, responses[0].response_put.header.revision)
                finally:
                    self._set_leader(False)
                    self._lease = None
                # A holder that lost its lease is the likeliest to be in trouble (slow, cut
                # off): give the others one TTL to take over before campaigning again.
                await asyncio.sleep(self.ttl_s)
                continue
            # Not ours: the lease we took for the attempt is of no use while we wait.
            await session.revoke(lease)
            held = responses[0]
            revision = held[0][1].mod_revision if held else 0
            await self._wait_vacant(revision)

    async def _wait_vacant(self, revision: int) -> None:
        """Returns once the key has been deleted after `revision` (or after a TTL, to re-check)."""
        if revision == 0:
            return
        watch = await self.session.watch(self.key, start_revision=revision + 1)

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
            await cancel_watch(watch)

    async def _read_key(self) -> tuple[bytes | None, int]:
        """The key's value now (None: absent) and the revision of that read."""
        result = await self.session.get_prefix(self.key)
        value = next((kv.value for kv in result if kv.key == self.key), None)
        return value, result.header.revision

    async def _follow_key(self, revision: int, lost: asyncio.Event) -> None:
        """Sets `lost` once the key is deleted or holds another identity after `revision`. A
        watch that ends or fails without saying so (the session's client dropped, etcd away) is
        opened again after a read of the key, which covers whatever happened while none was
        open; meanwhile the refreshes guard the term."""
        backoff = reconnect_backoff(self.config)
        while True:
            watch = None
            try:
                watch = await self.session.watch(self.key, start_revision=revision + 1)
                async for event in watch:
                    if event.kind == "DELETE" or event.kv.value != self.identity.encode():
                        lost.set()
                        return
            except ETCD_ERRORS as exc:
                log.debug("leader lock %s: watch lost, watching again: %s", self.key.decode(), exc)
            finally:
                await cancel_watch(watch)
            await asyncio.sleep(next_wait(backoff))
            try:
                value, revision = await self._read_key()
            except ETCD_ERRORS:
                continue  # still away: watch from the old revision, or fail and wait longer
            if value != self.identity.encode():
                lost.set()
                return
            backoff.streak = 0

    async def _hold(self, lease: int, revision: int) -> None:
        """Keeps the lease alive; returns when leadership is lost."""
        lost = asyncio.Event()
        follower = asyncio.create_task(self._follow_key(revision, lost), name=f"leader-watch-{self.key.decode()}")
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
                    ttl = await self.session.refresh(lease)
                if ttl <= 0:
                    log.warning("leader lease of %s expired", self.key.decode())
                    break
        finally:
            await stop_task(follower)
