"""One etcd session: the only place Ballast connects to etcd, reconnects, resyncs and keeps leases.

An `EtcdSession` holds one client (`etcd_client.make_client`: every member of the config, TLS,
a user). A call that fails drops that client, so the next call connects again, starting at the
next member: a member that died is left for another. Every reconnect loop waits by the same
`reconnect_backoff` (from `etcd.reconnect_backoff_s`, doubling up to `MAX_BACKOFF_S`, back to the
start once a connection worked).

On top of it:
- `watch_prefix`: a full read, then a watch from the read's revision; after a loss it reads the
  prefix again and reports what changed meanwhile (keys written and keys gone), so a consumer
  never misses a change and keeps its last view while etcd is away.
- `KeptLease`: a lease kept alive by its owner's refreshes, granted again when etcd lost it (the
  owner is told), revoked once on a clean stop. Refreshes go over one LeaseKeepAlive stream per
  client (`etcd_keepalive`), not a stream each.

One session per process: a service's app builds it and hands it to every part that reaches etcd
(its watches, leases and calls share the one client), and the app alone closes it, after those
parts stopped. A part given a session never closes it: stopping a watch cancels only that watch,
revoking a kept lease only that lease. A failed or cut-short call (any part's) drops the shared
client; every watch then reads its prefix again and every kept lease is refreshed on the next
client, so one part's failure costs the others a resync, never a lost view or lease. The calls
still on the dropped client fail with `EtcdCallCut` (an etcd error like any other), never with
the bare cancellation gRPC gives them, which would end the loop that made them.

`close()` is idempotent and stops the session's watches; the session can be used again after it
(a later call connects again).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aetcd
import aetcd.exceptions

from services.common.backoff import BackoffPolicy, RestartBackoff
from services.common.config import EtcdConfig
from services.common.etcd_client import MEMBER_CONNECT_TIMEOUT_S, make_client
from services.common.etcd_keepalive import KeepAliveStream
from services.common.tasks import cancelled_from_outside, stop_task

log = logging.getLogger(__name__)

# What a lost or refused etcd connection raises through aetcd (and a call past its deadline).
ETCD_ERRORS = (aetcd.exceptions.ClientError, OSError, asyncio.TimeoutError)


class EtcdCallCut(ConnectionError):
    """A call cut short because its client was closed under it: another part's failure dropped
    the shared client, and closing a gRPC channel cancels the calls still on it. gRPC reports
    those as a cancellation, which must not pass for the caller's own: an `asyncio.CancelledError`
    that nobody asked of the task would end a watch's or a lease's loop for good."""


# The longest wait between two reconnect attempts: etcd back after an outage is seen within it.
MAX_BACKOFF_S = 5.0

# A stop must never hang on ending a watch (ours end at once, never waiting on etcd).
WATCH_CANCEL_TIMEOUT_S = 1.0


def reconnect_backoff(config: EtcdConfig) -> RestartBackoff:
    """The waits between reconnect attempts (one streak per loop; `streak = 0` once connected)."""
    initial = config.reconnect_backoff_s
    return RestartBackoff(BackoffPolicy(initial_s=initial, max_s=max(initial, MAX_BACKOFF_S), factor=2.0))


def next_wait(backoff: RestartBackoff) -> float:
    """The next wait of a loop whose connection failed again."""
    return backoff.next_delay(0.0)


async def close_client(client: aetcd.Client | None) -> None:
    """Closes a client that may already be broken (closing a dead channel can fail; it is gone
    either way)."""
    if client is not None:
        try:
            await client.close()
        except Exception:  # noqa: BLE001 - see above
            pass


@dataclass(frozen=True)
class Change:
    """One key written (`value` set) or gone (`value` None) under a watched prefix."""

    key: bytes
    value: bytes | None
    lease: int = 0
    mod_revision: int = 0

    @property
    def deleted(self) -> bool:
        return self.value is None


async def cancel_watch(watch: Any) -> None:
    """Cancels one raw watch, leaving the client's other watches running (best effort: the
    client may be closed already, and its watches with it)."""
    if watch is None:
        return
    try:
        async with asyncio.timeout(WATCH_CANCEL_TIMEOUT_S):
            await watch.cancel()
    except Exception:  # noqa: BLE001 - see above; a stop must not fail on it
        pass


async def _call(handler: Callable[..., Any] | None, *args: Any) -> None:
    if handler is None:
        return
    result = handler(*args)
    if inspect.isawaitable(result):
        await result


class EtcdSession:
    """One lazily connected etcd client with failover; every call has the config's deadline."""

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self._client: aetcd.Client | None = None
        self._connect_lock = asyncio.Lock()
        self._watches: set[PrefixWatch] = set()
        # Every lease of the session is refreshed on one stream of the current client.
        self.keepalive = KeepAliveStream()
        self.connects = 0
        """How many clients this session has connected (the first, then one per reconnect)."""
        # A call may first have to find a live member: give it time for that as well.
        self.call_timeout_s = config.timeout_s + MEMBER_CONNECT_TIMEOUT_S * len(config.members)

    # -- the client --------------------------------------------------------------------------

    @property
    def member(self) -> str | None:
        """host:port of the member the session speaks to now (None: not connected)."""
        return getattr(self._client, "member", None)

    async def client(self) -> aetcd.Client:
        """The connected client (connecting one, at the next member in turn, when there is none)."""
        client = self._client
        if client is not None:
            return client
        async with self._connect_lock:
            if self._client is None:
                client = make_client(self.config)
                try:
                    await client.connect()
                except BaseException:
                    await close_client(client)
                    raise
                self._client = client
                self.connects += 1
            return self._client

    async def reset(self, client: aetcd.Client | None = None) -> None:
        """Drops the client (or `client`, if it is still the current one) after a failure; the
        next call connects again, at the next member."""
        if client is None:
            client = self._client
        if client is not None and client is self._client:
            self._client = None
        self.keepalive.drop(client)
        await close_client(client)

    async def _run(self, operation: Callable[[aetcd.Client], Awaitable[Any]]) -> Any:
        client = None
        try:
            async with asyncio.timeout(self.call_timeout_s):
                client = await self.client()
                return await operation(client)
        except ETCD_ERRORS:
            if client is not None:
                await self.reset(client)
            raise
        except asyncio.CancelledError:
            if client is not None:
                # A caller's own deadline cut the call short: a client whose call hung is no
                # better than a broken one. (Cut under us, the client is closed already.)
                await self.reset(client)
            if cancelled_from_outside():
                raise
            raise EtcdCallCut("the etcd client was closed while the call was on it") from None

    # -- keys --------------------------------------------------------------------------------

    async def get(self, key: bytes) -> Any:
        """The key's value and metadata (aetcd's KeyValue), or None."""
        return await self._run(lambda c: c.get(key))

    async def get_prefix(self, prefix: bytes) -> Any:
        """Every key under `prefix` (iterable of KeyValue; `.header.revision` is the read's)."""
        return await self._run(lambda c: c.get_prefix(prefix))

    async def put(self, key: bytes, value: bytes, lease: int | None = None) -> Any:
        return await self._run(lambda c: c.put(key, value, lease=lease or None))

    async def delete(self, key: bytes) -> Any:
        return await self._run(lambda c: c.delete(key))

    @property
    def transactions(self) -> aetcd.client.Transactions:
        """Builders of a transaction's compares and operations."""
        return aetcd.client.Transactions()

    async def transaction(self, compare: list, success: list, failure: list) -> tuple[bool, list]:
        return await self._run(lambda c: c.transaction(compare=compare, success=success, failure=failure))

    async def watch(self, key: bytes, start_revision: int) -> Any:
        """A raw watch of one key from `start_revision` (the caller cancels it); for a watch that
        survives reconnects use `watch_prefix`."""
        return await self._run(lambda c: c.watch(key, start_revision=start_revision))

    # -- leases ------------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; its id."""
        lease = await self._run(lambda c: c.lease(ttl_s))
        return lease.id

    async def refresh(self, lease_id: int) -> int:
        """Refreshes a lease; its remaining seconds (<= 0: etcd no longer holds it)."""
        return await self._run(lambda c: self.keepalive.refresh(c, lease_id))

    async def revoke(self, lease_id: int) -> bool:
        """Revokes a lease, so its keys go at once; False (logged) when etcd cannot be reached:
        the lease then expires on its own."""
        try:
            await self._run(lambda c: c.revoke_lease(lease_id))
            return True
        except ETCD_ERRORS as exc:
            log.warning("could not revoke etcd lease %x (it will expire): %s", lease_id, exc)
            return False

    async def lease_ttl(self, lease_id: int) -> int:
        """A lease's remaining seconds (-1: gone), without refreshing it."""
        info = await self._run(lambda c: c.get_lease_info(lease_id, keys=False))
        return info.TTL

    def kept_lease(self, ttl_s: int, on_granted: Callable[[int], None] | None = None) -> "KeptLease":
        return KeptLease(self, ttl_s, on_granted)

    # -- watches -----------------------------------------------------------------------------

    def watch_prefix(
        self,
        prefix: bytes,
        on_sync: Callable[[dict[bytes, Change], list[Change]], Any] | None = None,
        on_change: Callable[[Change], Any] | None = None,
        on_lost: Callable[[BaseException], Any] | None = None,
        name: str = "",
    ) -> "PrefixWatch":
        """A prefix watch (not started: `await watch.start()`), stopped by `close()` too."""
        watch = PrefixWatch(self, prefix, on_sync, on_change, on_lost, name)
        self._watches.add(watch)
        return watch

    # -- lifetime ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Stops the session's watches and closes its client; closing twice is fine."""
        watches, self._watches = list(self._watches), set()
        for watch in watches:
            await watch.stop()
        await self.reset()

    async def __aenter__(self) -> "EtcdSession":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class KeptLease:
    """A lease its owner keeps alive by calling `ensure()` at its own pace (more often than the
    TTL); granted again when etcd no longer holds it, and the owner told through `on_granted`."""

    def __init__(self, session: EtcdSession, ttl_s: int, on_granted: Callable[[int], None] | None = None) -> None:
        self.session = session
        self.ttl_s = ttl_s
        self._on_granted = on_granted
        self.id: int | None = None
        self.grants = 0
        """How many leases were granted (the first, then one per loss)."""

    async def ensure(self) -> int:
        """Refreshes the lease (a reconnect keeps it while etcd holds it: keys under it stay the
        same incarnation); grants a new one when it expired or was never granted."""
        if self.id is not None:
            if await self.session.refresh(self.id) > 0:
                return self.id
            log.info("etcd lease %x expired: granting a new one", self.id)
        self.id = await self.session.grant(self.ttl_s)
        self.grants += 1
        if self._on_granted is not None:
            self._on_granted(self.id)
        return self.id

    async def revoke(self) -> None:
        """Revokes the lease (its keys go at once); a failure is logged and the lease expires."""
        lease_id, self.id = self.id, None
        if lease_id is not None:
            await self.session.revoke(lease_id)

    def forget(self) -> None:
        """Drops the lease without revoking it: it expires as a dead process's would."""
        self.id = None


class PrefixWatch:
    """Follows every key under a prefix: a full read, then a watch; resyncs after every loss."""

    def __init__(
        self,
        session: EtcdSession,
        prefix: bytes,
        on_sync: Callable[[dict[bytes, Change], list[Change]], Any] | None,
        on_change: Callable[[Change], Any] | None,
        on_lost: Callable[[BaseException], Any] | None,
        name: str,
    ) -> None:
        self.session = session
        self.prefix = prefix
        self._on_sync = on_sync
        self._on_change = on_change
        self._on_lost = on_lost
        self.name = name or f"watch-{prefix.decode(errors='replace')}"
        # What the last read and the events since say is under the prefix.
        self._known: dict[bytes, Change] = {}
        self._task: asyncio.Task | None = None
        self.synced = asyncio.Event()
        """Set while the watch follows etcd (after a read); cleared when it is lost."""
        self.syncs = 0
        """Full reads so far (the first, then one per reconnect)."""
        self.retry_wait_s = 0.0
        """The wait before the latest reconnect (it grows while etcd stays away)."""

    def snapshot(self) -> dict[bytes, Change]:
        """The keys under the prefix as last seen (kept while etcd is away)."""
        return dict(self._known)

    async def start(self) -> None:
        if self._task is None:
            # Known to the session again, so a later close() stops it too (after a restart).
            self.session._watches.add(self)
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Stops this watch alone (its etcd watch is cancelled: the session's others go on)."""
        await stop_task(self._task)
        self._task = None
        self.synced.clear()
        self.session._watches.discard(self)

    def _resync(self, result: Any) -> tuple[dict[bytes, Change], list[Change]]:
        fresh = {kv.key: Change(kv.key, kv.value, kv.lease, kv.mod_revision) for kv in result}
        changes = [
            c for key, c in fresh.items() if key not in self._known or self._known[key].mod_revision != c.mod_revision
        ]
        changes += [Change(key, None) for key in self._known if key not in fresh]
        self._known = fresh
        return dict(fresh), changes

    async def _follow(self) -> None:
        session = self.session
        result = await session.get_prefix(self.prefix)
        snapshot, changes = self._resync(result)
        self.syncs += 1
        self.synced.set()
        await _call(self._on_sync, snapshot, changes)
        client = await session.client()
        watch = None
        try:
            watch = await client.watch_prefix(self.prefix, start_revision=result.header.revision + 1)
            async for event in watch:
                kv = event.kv
                change = (
                    Change(kv.key, None, 0, kv.mod_revision)
                    if event.kind == "DELETE"
                    else Change(kv.key, kv.value, kv.lease, kv.mod_revision)
                )
                if change.deleted:
                    self._known.pop(kv.key, None)
                else:
                    self._known[kv.key] = change
                await _call(self._on_change, change)
        except ETCD_ERRORS:
            # The client is broken: the next read connects again (at the next member).
            await session.reset(client)
            raise
        finally:
            # The client outlives this watch: end its stream, or etcd keeps sending its events.
            await cancel_watch(watch)

    async def _run(self) -> None:
        backoff = reconnect_backoff(self.session.config)
        while True:
            try:
                await self._follow()
                # A watch that ends without an error means etcd closed it: resync.
            except ETCD_ERRORS as exc:
                if self.synced.is_set():
                    log.debug("%s lost, resyncing: %s", self.name, exc)
                await _call(self._on_lost, exc)
            except asyncio.CancelledError:
                if cancelled_from_outside():
                    raise
                # A call of this watch's own cut by its client's close (the watch stream's, not
                # made through `_run`): the watch is lost like any other way.
                await _call(self._on_lost, EtcdCallCut("the etcd client was closed under the watch"))
            except Exception:  # a consumer's bug must not end the watch for good; read again later
                log.exception("%s: a handler failed, resyncing", self.name)
            if self.synced.is_set():
                backoff.streak = 0  # the last connection worked: start over from the shortest wait
            self.synced.clear()
            self.retry_wait_s = next_wait(backoff)
            await asyncio.sleep(self.retry_wait_s)
