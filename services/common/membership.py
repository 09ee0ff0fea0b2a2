"""Worker membership in etcd: workers publish a leased record; routers watch the prefix.

A worker's record lives at `<prefix>workers/<id>` under a lease of a few seconds that the
worker refreshes about once a second; it writes the record (its current load, health,
temperature) at that heartbeat when something in it changed, and at least every
`record_refresh_s` otherwise. When a worker dies,
its lease expires, etcd deletes the key, and every router's watch drops it: no polling.
Both sides survive the loss and return of etcd: the worker re-grants its lease and
re-publishes; the router keeps the last known membership and resynchronises. Connections,
reconnects, the lease and the watch are an `EtcdSession`'s: the process's, handed in by its
app (which closes it), or one of their own when used alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Awaitable, Callable

from services.common.config import EtcdConfig
from services.common.etcd_client import make_client  # noqa: F401  (re-exported: callers import it from here)
from services.common.etcd_session import (  # noqa: F401  (ETCD_ERRORS, close_client re-exported)
    ETCD_ERRORS,
    Change,
    EtcdSession,
    close_client,
    next_wait,
    reconnect_backoff,
)
from services.common.telemetry import DependencyStatus
from services.common.tasks import stop_task

log = logging.getLogger(__name__)


@dataclass
class WorkerRecord:
    """What a worker publishes about itself (JSON in etcd, readable with etcdctl)."""

    id: str
    address: str
    model: str
    model_version: str
    pool: str = "primary"
    capacity: int = 1
    in_flight: int = 0
    queued: int = 0
    kv_used: float = 0.0
    temperature_c: float | None = None
    healthy: bool = True
    draining: bool = False
    # A warm standby: model loaded, not routable until promoted (it then publishes
    # standby=false). It also publishes healthy=false, so routers that skip unhealthy
    # workers skip it without knowing this field.
    standby: bool = False
    max_context: int = 0
    # The worker serves Worker/Relay (many requests over one stream); older workers publish
    # no such field and get a Generate call per request.
    relay: bool = False
    started_at: float = field(default_factory=time.time)
    # When the record was last written (an unchanged record is written at most every
    # record_refresh_s; the lease, refreshed every heartbeat, says the worker is alive).
    updated_at: float = field(default_factory=time.time)
    # Filled from etcd on read, never written: which lease holds the record.
    lease_id: int = 0

    def to_json(self) -> bytes:
        data = asdict(self)
        data.pop("lease_id")
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, lease_id: int = 0) -> "WorkerRecord":
        data = json.loads(raw)
        known = {name for name in cls.__dataclass_fields__}
        # Newer workers may publish fields this router does not know yet: ignore them.
        record = cls(**{k: v for k, v in data.items() if k in known and k != "lease_id"})
        record.lease_id = lease_id
        return record

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and not self.standby


def workers_prefix(config: EtcdConfig) -> str:
    return f"{config.prefix}workers/"


def worker_key(config: EtcdConfig, worker_id: str) -> str:
    return f"{workers_prefix(config)}{worker_id}"


class WorkerRegistration:
    """Keeps one worker's leased record in etcd fresh until stopped."""

    def __init__(
        self,
        config: EtcdConfig,
        snapshot: Callable[[], WorkerRecord],
        dependencies: DependencyStatus,
        session: EtcdSession | None = None,
    ) -> None:
        self.config = config
        self._snapshot = snapshot
        self._dependencies = dependencies
        # The process's session when given (its owner closes it), else one of its own.
        self._owns_session = session is None
        self.session = session or EtcdSession(config)
        # Kept across reconnects: a failed call resets the connection, not necessarily the
        # lease, and a new lease would make routers see a new incarnation of this worker (and
        # fail over its streams) after a mere hiccup.
        self._lease = self.session.kept_lease(config.lease_ttl_s)
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.registered = asyncio.Event()
        # What was last written, under which lease, and when (monotonic): an unchanged record
        # under the same lease is not written again before record_refresh_s.
        # (Compared as records, not as their JSON: encoding it at every heartbeat was most of
        # an idle worker's Python work.)
        self._written: tuple[int, WorkerRecord] | None = None
        self._written_at = 0.0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="etcd-registration")

    def publish_now(self) -> None:
        """Publishes at once instead of at the next heartbeat (e.g. on draining)."""
        self._wake.set()

    async def _publish(self) -> None:
        lease_id = await self._lease.ensure()
        record = self._snapshot()
        content = (lease_id, replace(record, updated_at=0.0))
        if content == self._written and time.monotonic() - self._written_at < self.config.record_refresh_s:
            return  # the lease is refreshed; the record in etcd already says all this
        record.updated_at = time.time()
        await self.session.put(worker_key(self.config, record.id).encode(), record.to_json(), lease=lease_id)
        self._written, self._written_at = content, time.monotonic()

    def _write_again(self) -> None:
        # etcd may have come back without its data: write the record again at the next try.
        # (The failed call dropped its client already; the session may be shared, so this
        # leaves the session's client alone.)
        self._written = None

    async def _run(self) -> None:
        backoff = reconnect_backoff(self.config)
        while True:
            try:
                async with asyncio.timeout(self.session.call_timeout_s * 2):
                    await self._publish()
                self._dependencies.set("etcd", True)
                self.registered.set()
                backoff.streak = 0
                delay = self.config.heartbeat_s
            except ETCD_ERRORS as exc:
                if self._dependencies.is_up("etcd") or not self.registered.is_set():
                    log.warning("etcd unreachable, will retry: %s", exc)
                self._dependencies.set("etcd", False)
                self._write_again()
                delay = next_wait(backoff)
            self._wake.clear()
            try:
                # asyncio.timeout, not wait_for: wait_for can swallow the cancel that stops us.
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def abandon(self) -> None:
        """Stops refreshing without revoking: the lease expires as a dead process's would
        (a simulated worker's crash)."""
        await stop_task(self._task)
        self._task = None
        self._lease.forget()
        self._write_again()
        if self._owns_session:
            await self.session.close()

    async def stop(self) -> None:
        """Stops refreshing and revokes the lease, so routers drop this worker at once."""
        await stop_task(self._task)
        self._task = None
        await self._lease.revoke()
        self._write_again()
        if self._owns_session:
            await self.session.close()


Listener = Callable[[dict[str, WorkerRecord]], Awaitable[None] | None]


class GoneEvent(asyncio.Event):
    """Set when a worker's record leaves etcd. `draining` says the worker said goodbye: its
    last record was marked draining, so it revoked its lease after finishing (or handing
    back) its streams, and a stream still being relayed from it is ending, not lost."""

    def __init__(self) -> None:
        super().__init__()
        self.draining = False


class MembershipWatcher:
    """The router's live view of workers: a full read, then a prefix watch; resyncs after loss."""

    def __init__(self, config: EtcdConfig, dependencies: DependencyStatus, session: EtcdSession | None = None) -> None:
        self.config = config
        self._dependencies = dependencies
        self._workers: dict[str, WorkerRecord] = {}
        # The process's session when given (its owner closes it), else one of its own.
        self._owns_session = session is None
        self.session = session or EtcdSession(config)
        self._watch = self.session.watch_prefix(
            workers_prefix(config).encode(), self._on_sync, self._on_change, self._on_lost, name="etcd-membership"
        )
        self._changed = asyncio.Condition()
        self.synced = asyncio.Event()
        # Bumped on every change, so waiters can tell "changed since I looked".
        self.version = 0
        # One event per worker that someone waits on, set when its record disappears.
        self._gone: dict[str, GoneEvent] = {}

    def workers(self) -> dict[str, WorkerRecord]:
        return dict(self._workers)

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def gone_event(self, worker_id: str) -> GoneEvent:
        """An event set once the worker's record leaves etcd (lease expired or revoked)."""
        event = self._gone.get(worker_id)
        if event is None:
            event = self._gone[worker_id] = GoneEvent()
            if worker_id not in self._workers:
                event.set()
        return event

    def _mark_gone(self, gone: dict[str, WorkerRecord | None]) -> None:
        """`gone`: each worker that left, with its last record."""
        for worker_id, last in gone.items():
            event = self._gone.pop(worker_id, None)
            if event is not None:
                event.draining = last is not None and last.draining
                event.set()

    async def start(self) -> None:
        await self._watch.start()

    async def stop(self) -> None:
        await self._watch.stop()
        if self._owns_session:
            await self.session.close()

    async def wait_for(self, predicate: Callable[[dict[str, WorkerRecord]], bool], timeout: float) -> bool:
        """Waits until the membership satisfies `predicate`; False on timeout."""

        async def _wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: predicate(self._workers))

        try:
            await asyncio.wait_for(_wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def changed(self, since: int, timeout: float) -> bool:
        """Waits until the membership changed after version `since`; False on timeout."""
        return await self.wait_for(lambda _workers: self.version != since, timeout)

    async def _notify(self) -> None:
        self.version += 1
        async with self._changed:
            self._changed.notify_all()

    def _worker_id(self, key: bytes) -> str:
        return key.decode()[len(workers_prefix(self.config)) :]

    def _record(self, change: Change) -> WorkerRecord | None:
        try:
            return WorkerRecord.from_json(change.value, change.lease)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring malformed worker record %s: %s", change.key, exc)
            return None

    async def _on_sync(self, snapshot: dict[bytes, Change], _changes: list[Change]) -> None:
        fresh: dict[str, WorkerRecord] = {}
        for key, change in snapshot.items():
            record = self._record(change)
            if record is not None:
                fresh[self._worker_id(key)] = record
        self._mark_gone({w: record for w, record in self._workers.items() if w not in fresh})
        self._workers = fresh
        self._dependencies.set("etcd", True)
        self.synced.set()
        await self._notify()

    async def _on_change(self, change: Change) -> None:
        worker_id = self._worker_id(change.key)
        if change.deleted:
            self._mark_gone({worker_id: self._workers.pop(worker_id, None)})
        else:
            record = self._record(change)
            if record is not None:
                self._workers[worker_id] = record
        await self._notify()

    def _on_lost(self, exc: BaseException) -> None:
        self.synced.clear()
        if self._dependencies.is_up("etcd"):
            log.warning("etcd watch lost, keeping last membership: %s", exc)
        self._dependencies.set("etcd", False)
