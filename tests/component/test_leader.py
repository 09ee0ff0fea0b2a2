"""The etcd leader lock against a real etcd: one leader among candidates, takeover on loss."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.common.config import EtcdConfig
from services.common.leader import LeaderLock
from services.common.membership import make_client

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def etcd_config(etcd_server):
    return EtcdConfig(host=etcd_server.host, port=etcd_server.port, prefix=f"/leader-test-{uuid.uuid4().hex[:8]}/")


async def _wait(predicate, timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


async def _revoke(config: EtcdConfig, lease_id: int) -> None:
    client = make_client(config)
    await client.connect()
    try:
        await client.revoke_lease(lease_id)
    finally:
        await client.close()


async def test_two_candidates_one_leader_and_takeover_when_the_lease_is_revoked(etcd_config):
    changes: dict[str, list[bool]] = {"a": [], "b": []}
    a = LeaderLock(etcd_config, "autoscaler", "router-a", ttl_s=3, on_change=changes["a"].append)
    b = LeaderLock(etcd_config, "autoscaler", "router-b", ttl_s=3, on_change=changes["b"].append)
    await a.start()
    assert await a.wait_leader(10)
    await b.start()
    try:
        # b campaigns and loses while a holds the key: it stays a follower.
        await asyncio.sleep(1.5)
        assert a.is_leader and not b.is_leader
        assert await a.holder() == "router-a"

        await _revoke(etcd_config, a.lease_id)
        assert await b.wait_leader(15), "b did not take over after a's lease was revoked"
        assert await _wait(lambda: not a.is_leader, 10), "a kept acting as leader without its lease"
        assert await b.holder() == "router-b"
        # Never two leaders at once, observed over a while after the takeover.
        for _ in range(20):
            assert not (a.is_leader and b.is_leader)
            await asyncio.sleep(0.05)
        assert changes["a"] == [True, False]
        assert changes["b"] == [True]
    finally:
        await a.stop()
        await b.stop()


async def test_resigning_hands_over_at_once_and_a_dead_leader_after_its_ttl(etcd_config):
    a = LeaderLock(etcd_config, "autoscaler", "router-a", ttl_s=2)
    b = LeaderLock(etcd_config, "autoscaler", "router-b", ttl_s=2)
    c = LeaderLock(etcd_config, "autoscaler", "router-c", ttl_s=2)
    await a.start()
    assert await a.wait_leader(10)
    await b.start()
    await asyncio.sleep(0.5)
    # A clean stop revokes the lease: b does not wait for the TTL to run out.
    await a.stop()
    assert await b.wait_leader(5)
    assert await a.holder() == "router-b"

    # A leader that dies without resigning (its task killed, lease left to expire).
    await c.start()
    await asyncio.sleep(0.5)
    assert not c.is_leader
    b._task.cancel()
    assert await c.wait_leader(15), "c did not take over after b's lease expired"
    assert await c.holder() == "router-c"
    await c.stop()
    assert await c.holder() is None
    b._task = None
    await b.stop()


def test_a_too_short_ttl_is_refused():
    with pytest.raises(ValueError, match="ttl_s"):
        LeaderLock(EtcdConfig(), "x", "me", ttl_s=1)
