"""The etcd session against real etcd: one server stopped and started again, and a cluster of
three members one of which is killed.

With one server: while etcd is away the session's prefix watch retries with growing waits;
changes made while the watch is away (held in its own loss hook, with etcd back) are reported
on its return, and only those; a kept lease survives the reconnect and, once etcd no longer
holds it, is granted again and its owner told. With three members: killing the member the
session speaks to moves it to a survivor, and the watch keeps reporting. `close()` twice is fine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest

from services.cli.etcd_cluster import LocalEtcdCluster
from services.common.config import EtcdConfig
from services.common.etcd_session import ETCD_ERRORS, Change, EtcdSession

pytestmark = pytest.mark.integration

INITIAL_BACKOFF_S = 0.1


async def until(condition, timeout: float, what: str) -> None:
    """Returns once `condition()` holds; fails after `timeout` (a bound, not a measurement)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {timeout:.0f}s"
        await asyncio.sleep(0.05)


class Recorder:
    """What a prefix watch reported: each resync's changes, and each live change."""

    def __init__(self) -> None:
        self.resyncs: list[dict[bytes, bytes | None]] = []
        self.live: list[Change] = []
        self.losses = 0
        # Set by the test to keep the watch away after its next loss, until `resume` is set.
        self.hold = False
        self.held = asyncio.Event()
        self.resume = asyncio.Event()

    def on_sync(self, _snapshot: dict[bytes, Change], changes: list[Change]) -> None:
        self.resyncs.append({c.key: c.value for c in changes})

    def on_change(self, change: Change) -> None:
        self.live.append(change)

    async def on_lost(self, _exc: BaseException) -> None:
        self.losses += 1
        if self.hold:
            self.hold = False
            self.held.set()
            await self.resume.wait()

    def seen(self, key: bytes) -> bytes | None:
        """The latest value reported for `key` (by a resync or live)."""
        value = None
        for resync in self.resyncs:
            value = resync.get(key, value)
        for change in self.live:
            if change.key == key:
                value = change.value
        return value


async def reachable(session: EtcdSession, timeout: float = 15) -> None:
    """Returns once a call through `session` succeeds (each failure makes it connect again)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await session.get(b"/")
            return
        except ETCD_ERRORS:
            assert asyncio.get_running_loop().time() < deadline, "etcd did not answer again"
            await asyncio.sleep(0.1)


async def put_through(member, key: bytes, value: bytes, timeout: float = 30) -> None:
    """Writes through one member, again until it takes it (a killed leader: an election first)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await asyncio.to_thread(member.put, key, value)
            return
        except (OSError, ValueError, RuntimeError) as exc:
            assert asyncio.get_running_loop().time() < deadline, f"{member.name} took no write: {exc!r}"
            await asyncio.sleep(0.1)


def config_for(prefix: str, **where) -> EtcdConfig:
    return EtcdConfig(prefix=prefix, timeout_s=1.0, reconnect_backoff_s=INITIAL_BACKOFF_S, **where)


async def test_a_restarted_etcd_is_reconnected_with_backoff_and_the_watch_reports_what_changed(restartable_etcd):
    etcd = restartable_etcd
    prefix = f"/session-{uuid.uuid4().hex[:8]}/"
    config = config_for(prefix, host=etcd.host, port=etcd.port)
    root = f"{prefix}things/".encode()
    key = {name: root + name.encode() for name in "abcd"}
    granted: list[int] = []
    recorder = Recorder()
    async with EtcdSession(config) as session, EtcdSession(config) as writer:
        for name in "abd":
            await writer.put(key[name], name.encode())
        watch = session.watch_prefix(root, recorder.on_sync, recorder.on_change, recorder.on_lost)
        await watch.start()
        await until(lambda: watch.synced.is_set(), 10, "first read")
        assert recorder.resyncs == [{key["a"]: b"a", key["b"]: b"b", key["d"]: b"d"}]
        lease = session.kept_lease(2, on_granted=granted.append)
        first = await lease.ensure()
        leased = f"{prefix}leased".encode()
        await session.put(leased, b"x", lease=first)
        assert granted == [first]

        await asyncio.to_thread(etcd.stop)
        await until(lambda: recorder.losses >= 1, 15, "watch lost")
        # Every retry fails while etcd is away, and each waits longer than the one before.
        await until(lambda: watch.retry_wait_s >= 4 * INITIAL_BACKOFF_S, 30, "backoff grown")
        assert not watch.synced.is_set()
        with pytest.raises(ETCD_ERRORS):
            await lease.ensure()

        # Keep the watch away at its next loss, bring etcd back, and change things meanwhile.
        recorder.hold = True
        await asyncio.wait_for(recorder.held.wait(), 15)
        syncs_before = watch.syncs
        await asyncio.to_thread(etcd.restart)
        await reachable(writer)
        await writer.put(key["a"], b"a2")
        await writer.delete(key["b"])
        await writer.put(key["c"], b"c")
        recorder.resume.set()
        await until(lambda: watch.syncs > syncs_before, 30, "resync after etcd returned")
        assert recorder.resyncs[-1] == {key["a"]: b"a2", key["b"]: None, key["c"]: b"c"}, (
            "the resync reports exactly what changed while the watch was away (d did not)"
        )
        assert {k: c.value for k, c in watch.snapshot().items()} == {key["a"]: b"a2", key["c"]: b"c", key["d"]: b"d"}

        # etcd kept its data: the lease is kept across the reconnect, the owner told nothing.
        assert await lease.ensure() == first and granted == [first]
        assert (await session.get(leased)).lease == first
        assert session.connects >= 2
        # The live watch goes on after the resync.
        await writer.put(key["d"], b"d2")
        await until(lambda: recorder.seen(key["d"]) == b"d2", 10, "live change after the resync")

        # The lease gone from etcd (revoked elsewhere, as an expiry would): granted again, owner told.
        await writer.revoke(first)
        second = await lease.ensure()
        assert second != first and granted == [first, second]
        assert await session.get(leased) is None, "the key went with the lost lease"
        assert await session.lease_ttl(second) > 0

    # Leaving the block closed both; closing again is fine and stops nothing twice.
    await session.close()
    await session.close()
    assert not watch.synced.is_set() and watch._task is None


async def test_the_member_the_session_is_on_is_killed_and_it_moves_on_without_losing_the_watch(tmp_path):
    prefix = f"/session-{uuid.uuid4().hex[:8]}/"
    with LocalEtcdCluster(tmp_path, members=3) as cluster:
        config = config_for(prefix, endpoints=cluster.endpoints)
        root = f"{prefix}things/".encode()
        recorder = Recorder()
        session = EtcdSession(config)
        try:
            watch = session.watch_prefix(root, recorder.on_sync, recorder.on_change, recorder.on_lost)
            await watch.start()
            await until(lambda: watch.synced.is_set(), 15, "first read")
            lease = session.kept_lease(10)
            lease_id = await lease.ensure()
            first_member = session.member
            assert first_member in cluster.endpoints

            victim = next(m for m in cluster.members if m.address == first_member)
            survivors = [m for m in cluster.members if m is not victim]
            victim.process.kill()
            # Written through a survivor while the session's member is dead.
            await put_through(survivors[0], root + b"during", b"1")

            await until(lambda: recorder.seen(root + b"during") == b"1", 30, "the write reached the watch")
            assert session.member in {m.address for m in survivors}
            assert recorder.losses >= 1 and watch.syncs >= 2, "the watch resynced on another member"
            # The lease lives in the cluster, not the member: the same one is refreshed.
            assert await lease.ensure() == lease_id

            await put_through(survivors[1], root + b"after", b"2")
            await until(lambda: recorder.seen(root + b"after") == b"2", 15, "live change on the new member")
        finally:
            await session.close()
            await session.close()


async def test_every_lease_is_refreshed_on_one_keepalive_stream_and_each_refresh_gets_its_own_answer(
    restartable_etcd,
):
    etcd = restartable_etcd
    prefix = f"/session-{uuid.uuid4().hex[:8]}/"
    config = config_for(prefix, host=etcd.host, port=etcd.port)
    async with EtcdSession(config) as session, EtcdSession(config) as writer:
        kept, gone = session.kept_lease(30), session.kept_lease(30)
        kept_id, gone_id = await kept.ensure(), await gone.ensure()
        for _ in range(5):
            assert await session.refresh(kept_id) > 0
        assert session.keepalive.opened == 1, "refreshes share one stream, not a stream each"

        # One lease gone, refreshed side by side with a live one: each refresh reads the answer
        # to its own request (a mixed-up reply would give the gone lease time, the live one none).
        await writer.revoke(gone_id)
        answers = await asyncio.gather(*(session.refresh(i) for i in (kept_id, gone_id, kept_id, gone_id)))
        assert [ttl > 0 for ttl in answers] == [True, False, True, False]
        assert session.keepalive.opened == 1

        # A refresh cut between its request and its answer drops the stream (the answer still
        # due would be read as the next refresh's); the next one opens another and reads its own.
        # etcd is frozen meanwhile, so the refresh is caught waiting for its answer.
        os.kill(etcd.pid, signal.SIGSTOP)
        try:
            cut = asyncio.create_task(session.refresh(kept_id))
            await until(lambda: session.keepalive.busy or cut.done(), 5, "the refresh on the stream")
            assert not cut.done(), f"the refresh ended with etcd frozen: {cut.result()}"
            cut.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cut
        finally:
            os.kill(etcd.pid, signal.SIGCONT)
        assert await session.refresh(gone_id) <= 0
        assert await session.refresh(kept_id) > 0
        assert session.keepalive.opened == 2
        # The live lease lived through it: still the same one.
        assert await kept.ensure() == kept_id
