"""One `EtcdSession` shared by every part of a process: a part's watch stops alone, a part
given the session never closes it, a dropped client makes every watch resync on the next one,
and a leader's term survives a client dropped by another part (an in-memory etcd stands in,
tests/unit/fake_etcd.py; real etcd restarts are in tests/component/test_one_etcd_session.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.common import etcd_session
from services.common.config import EtcdConfig
from services.common.etcd_session import Change, EtcdSession
from services.common.etcd_watch import KeyWatcher
from services.common.leader import LeaderLock
from services.common.membership import MembershipWatcher
from services.common.quarantine import QuarantineStore
from services.common.quarantine_etcd import QuarantineWatch
from services.common.telemetry import DependencyStatus
from tests.unit.fake_etcd import FakeEtcd

CONFIG = EtcdConfig(prefix="/t/", reconnect_backoff_s=0.01)
BOUND_S = 5.0  # a bound on waits for the loop to run the watches, not a measurement


@pytest.fixture
def fake_etcd(monkeypatch) -> FakeEtcd:
    fake = FakeEtcd()
    monkeypatch.setattr(etcd_session, "make_client", fake.client)
    return fake


async def until(condition) -> None:
    async with asyncio.timeout(BOUND_S):
        while not condition():
            await asyncio.sleep(0.005)


class Seen:
    """A prefix watch's reports."""

    def __init__(self) -> None:
        self.syncs = 0
        self.changes: list[Change] = []

    def on_sync(self, _snapshot: dict[bytes, Change], _changes: list[Change]) -> None:
        self.syncs += 1

    def on_change(self, change: Change) -> None:
        self.changes.append(change)

    def values(self) -> list[bytes | None]:
        return [c.value for c in self.changes]


async def test_a_stopped_watch_ends_alone_and_close_ends_the_others_and_the_client_once(fake_etcd):
    session = EtcdSession(CONFIG)
    seen = {name: Seen() for name in "ab"}
    watches = {
        name: session.watch_prefix(f"/{name}/".encode(), seen[name].on_sync, seen[name].on_change) for name in "ab"
    }
    for watch in watches.values():
        await watch.start()
    await until(lambda: all(w.synced.is_set() for w in watches.values()))
    client = fake_etcd.open_clients[0]
    assert len(fake_etcd.clients) == 1 and len(client.watches) == 2, "both watches ride one client"

    await watches["a"].stop()
    assert [w.start for w in client.watches] == [b"/b/"], "a's etcd watch was cancelled, b's left alone"
    assert watches["a"] not in session._watches and not client.closed
    fake_etcd.put(b"/a/x", b"1")
    fake_etcd.put(b"/b/x", b"1")
    await until(lambda: seen["b"].values() == [b"1"])
    assert seen["a"].changes == []

    await session.close()
    await session.close()
    assert client.closed and not client.watches and watches["b"]._task is None
    assert len(fake_etcd.clients) == 1, "closing connected nothing new"


async def test_parts_given_the_session_stop_without_closing_it(fake_etcd):
    session = EtcdSession(CONFIG)
    rules: list[bytes | None] = []
    members = MembershipWatcher(CONFIG, DependencyStatus(), session)
    rules_watch = KeyWatcher(CONFIG, "/t/config/rules", rules.append, session)
    quarantine = QuarantineWatch(CONFIG, QuarantineStore(), session)
    for part in (members, rules_watch, quarantine):
        await part.start()
    await until(lambda: members.synced.is_set() and rules_watch.synced.is_set() and quarantine.synced.is_set())
    assert len(fake_etcd.clients) == 1

    await rules_watch.stop()
    await quarantine.stop()
    client = fake_etcd.open_clients[0]
    assert not client.closed and [w.start for w in client.watches] == [b"/t/workers/"]
    fake_etcd.put(b"/t/workers/w1", b'{"id": "w1", "address": "a:1", "model": "m", "model_version": "1"}')
    await until(lambda: "w1" in members.workers())

    await members.stop()
    assert not client.closed and not client.watches, "the owner closes the session, not its parts"
    await session.close()
    assert client.closed

    # Used alone, a part builds its own session and closes it when it stops.
    alone = KeyWatcher(CONFIG, "/t/config/rules", rules.append)
    await alone.start()
    await until(lambda: alone.synced.is_set())
    await alone.stop()
    assert fake_etcd.open_clients == []


async def test_a_client_dropped_by_one_part_makes_every_watch_resync_on_the_next(fake_etcd):
    session = EtcdSession(CONFIG)
    seen = {name: Seen() for name in "ab"}
    watches = [session.watch_prefix(f"/{name}/".encode(), seen[name].on_sync, seen[name].on_change) for name in "ab"]
    for watch in watches:
        await watch.start()
    await until(lambda: all(w.synced.is_set() for w in watches))
    first = fake_etcd.open_clients[0]

    await session.reset(first)  # as a failed call of any part does
    await until(lambda: all(s.syncs == 2 for s in seen.values()))
    assert first.closed and len(fake_etcd.open_clients) == 1 and session.connects == 2
    fake_etcd.put(b"/a/x", b"1")
    fake_etcd.put(b"/b/x", b"2")
    await until(lambda: seen["a"].values() == [b"1"] and seen["b"].values() == [b"2"])
    await session.close()


async def following_leader(fake_etcd):
    """A leader of "autoscaler" on its own session, watching its key: (session, lock, lost, follower)."""
    session = EtcdSession(CONFIG)
    lock = LeaderLock(CONFIG, "autoscaler", "router-a", session=session)
    fake_etcd.put(lock.key, b"router-a")
    lost = asyncio.Event()
    follower = asyncio.create_task(lock._follow_key(fake_etcd.revision, lost))
    await until(lambda: len(fake_etcd.open_clients) == 1 and fake_etcd.open_clients[0].watches)
    return session, lock, lost, follower


async def test_a_leader_keeps_its_term_when_another_part_drops_the_client(fake_etcd):
    session, lock, lost, follower = await following_leader(fake_etcd)

    await session.reset()  # another part's call failed
    await until(lambda: len(fake_etcd.open_clients) == 1 and fake_etcd.open_clients[0].watches)
    assert not lost.is_set(), "the key is still ours: the term goes on, watched again"

    fake_etcd.put(lock.key, b"router-b")
    await asyncio.wait_for(lost.wait(), BOUND_S)
    await follower
    await session.close()


async def test_a_leader_whose_key_went_while_it_was_not_watching_steps_down(fake_etcd):
    session, lock, lost, follower = await following_leader(fake_etcd)

    client = fake_etcd.open_clients[0]
    await client.close()  # the stream ends; the key is deleted before the next watch opens
    fake_etcd.delete(lock.key)
    await asyncio.wait_for(lost.wait(), BOUND_S)
    await follower
    await session.close()
