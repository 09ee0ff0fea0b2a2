"""Integration tests: a local 3-member etcd cluster started for real.

Each test starts its own cluster under tmp_path and stops it, whatever happens. They check
that a write through one member is read through another (with aetcd, the client Ballast
uses), that SIGKILLing the leader gets a new one elected by the two survivors, which keep
taking writes, and that the killed member, started again on the same ports and data dir,
rejoins and catches up. Waits are bounded polls, not fixed sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import aetcd
import pytest

from services.cli.etcd_cluster import EtcdMember, LocalEtcdCluster, NoLeaderError

pytestmark = pytest.mark.integration

TRANSIENT = (OSError, ValueError, RuntimeError)


@pytest.fixture
def cluster(tmp_path):
    with LocalEtcdCluster(tmp_path, members=3) as started:
        yield started


def _poll(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Wait until `condition()` holds (an exception counts as "not yet"); return the seconds."""
    t0 = time.monotonic()
    last: BaseException | None = None
    while True:
        try:
            if condition():
                return time.monotonic() - t0
        except TRANSIENT as e:
            last = e
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:.0f}s (last error: {last!r})"
        time.sleep(0.1)


def _new_leader(cluster: LocalEtcdCluster, old: EtcdMember) -> EtcdMember | None:
    try:
        leader = cluster.leader()
    except NoLeaderError:
        return None
    return leader if leader is not old and leader.alive() else None


async def test_write_through_one_member_read_through_another(cluster):
    members = cluster.members
    assert len(members) == 3 and len({m.port for m in members} | {m.peer_port for m in members}) == 6
    assert cluster.endpoints == [m.address for m in members]
    assert (cluster.address, cluster.host, cluster.port) == (members[0].address, "127.0.0.1", members[0].port)
    assert {p.pid for p in cluster.parts()} == {m.pid for m in members}
    assert all(Path(m.data_dir, "member").is_dir() for m in members)
    assert len({m.member_id() for m in members}) == 3
    assert cluster.leader() in members

    writer, reader = members[0], members[2]
    async with aetcd.Client(host=writer.host, port=writer.port, timeout=5) as client:
        await client.put(b"/ballast/cluster/k", b"v1")
    async with aetcd.Client(host=reader.host, port=reader.port, timeout=5) as client:
        got = await client.get(b"/ballast/cluster/k")
        assert got is not None and got.value == b"v1"
    # The third member holds it in its own store too.
    _poll(lambda: members[1].get("/ballast/cluster/k", serializable=True) == b"v1", 10, "replicated")


def test_leader_killed_new_leader_elected_and_old_one_rejoins(cluster):
    old = cluster.leader()
    old.put("/ballast/cluster/before", "1")
    pid = old.pid
    old.process.kill()
    assert not old.alive() and not Path(f"/proc/{pid}").exists()
    assert len(cluster.alive_members()) == 2

    elected_s = _poll(lambda: _new_leader(cluster, old) is not None, 15, "new leader elected")
    new = cluster.leader()
    survivors = cluster.alive_members()
    assert new in survivors and old not in survivors
    print(f"new leader {new.name} after {elected_s:.2f}s")

    # A write through a survivor that is not the leader goes through the new leader.
    follower = next(m for m in survivors if m is not new)
    _poll(lambda: follower.put("/ballast/cluster/during", "2") > 0, 15, "write through a survivor")
    assert new.get("/ballast/cluster/during") == b"2"
    cluster.wait_healthy(timeout=30)

    # Back on the same ports with the same data dir: it rejoins and catches up.
    old.start(timeout=30)
    assert old.alive() and old.pid != pid
    cluster.wait_healthy(timeout=30)
    assert len(cluster.alive_members()) == 3
    _poll(lambda: old.get("/ballast/cluster/during", serializable=True) == b"2", 15, "caught up")
    assert old.get("/ballast/cluster/before", serializable=True) == b"1"
    assert cluster.leader() in cluster.members


def test_whole_cluster_restart_keeps_data_new_membership_does_not(tmp_path):
    first = LocalEtcdCluster(tmp_path)
    try:
        first.start(timeout=60)
        first.members[1].put("/ballast/cluster/kept", "yes")
        first.stop()
        assert first.alive_members() == []
        first.start(timeout=60)
        assert first.members[2].get("/ballast/cluster/kept") == b"yes"
    finally:
        first.stop()

    # Same state dir, other ports: the old data is wiped, not half-joined.
    second = LocalEtcdCluster(tmp_path)
    try:
        second.start(timeout=60)
        assert second.members[0].get("/ballast/cluster/kept") is None
        assert second.leader() in second.members
    finally:
        second.stop()
