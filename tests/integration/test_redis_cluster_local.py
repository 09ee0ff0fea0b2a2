"""Integration tests: a local Valkey cluster (3 masters, 3 replicas) started for real.

Each test starts its own cluster under tmp_path and stops it, whatever happens. They check
that redis-py's cluster client spreads keys over every master, that SIGKILLing a master gets
its replica promoted by the cluster without losing a replicated write, and that the killed
node, started again, rejoins as a replica. Waits are bounded polls, not fixed sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import redis.cluster

from services.cli.redis_cluster import ClusterNode, LocalRedisCluster

pytestmark = pytest.mark.integration

KEY = "ballast:failover-key"


@pytest.fixture
def cluster(tmp_path):
    with LocalRedisCluster(tmp_path, masters=3, replicas_per_master=1) as started:
        yield started


def _poll(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Wait until `condition()` holds; return the seconds it took."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.1)
    return time.monotonic() - t0


def _write_replicated(cluster: LocalRedisCluster, key: str, value: str) -> ClusterNode:
    """Write `key` on its master; return the master once its replica holds the write.

    The SET and the WAIT go over one connection: WAIT counts the replicas that acknowledged
    this connection's own writes, so on a fresh connection (no writes) it returns at once
    whatever the replicas hold, and a replica lagging on a busy machine would be promoted
    without the key.
    """
    master = cluster.master_for_key(key)
    replica = cluster.replica_of(master)
    assert replica is not None, f"{master.name} has no replica"
    connection = redis.Redis(
        host=master.host, port=master.port, decode_responses=True, single_connection_client=True, socket_timeout=5.0
    )
    try:
        assert connection.set(key, value)
        assert connection.execute_command("WAIT", 1, 5000) >= 1, "the write did not reach a replica"
    finally:
        connection.close()
    assert replica.command("DBSIZE") == master.command("DBSIZE") == 1
    return master


def _kill_and_wait_failover(cluster: LocalRedisCluster, master: ClusterNode) -> ClusterNode:
    """SIGKILL `master`; return its replica once the cluster promoted it and is healthy."""
    replica = cluster.replica_of(master)
    assert replica is not None, f"{master.name} has no replica"
    master.kill()
    assert not master.alive()
    _poll(lambda: cluster.roles().get(replica.name) == "master", 15, f"{replica.name} promoted")
    cluster.wait_healthy(timeout=30)
    return replica


def test_keys_spread_over_every_master(cluster):
    roles = cluster.roles()
    assert sorted(roles.values()) == ["master"] * 3 + ["replica"] * 3
    assert cluster.url == f"redis://127.0.0.1:{cluster.nodes[0].port}/0"
    assert cluster.startup_nodes == [n.address for n in cluster.nodes]
    assert {p.pid for p in cluster.parts()} == {n.pid for n in cluster.nodes}
    assert all(Path(n.data_dir, "nodes.conf").is_file() for n in cluster.nodes)

    host, port = cluster.startup_nodes[0].split(":")
    client = redis.cluster.RedisCluster(host=host, port=int(port), decode_responses=True)
    try:
        for i in range(200):
            assert client.set(f"ballast:k{i}", str(i))
        assert [client.get(f"ballast:k{i}") for i in range(200)] == [str(i) for i in range(200)]
    finally:
        client.close()

    masters = [n for n in cluster.nodes if roles[n.name] == "master"]
    sizes = {n.name: n.command("DBSIZE") for n in masters}
    assert all(size > 0 for size in sizes.values()), sizes
    assert sum(sizes.values()) == 200
    for i in range(0, 200, 10):  # master_for_key names the node that holds the key
        assert cluster.master_for_key(f"ballast:k{i}").command("EXISTS", f"ballast:k{i}") == 1


def test_killed_master_is_replaced_by_its_replica(cluster):
    master = _write_replicated(cluster, KEY, "before-failover")
    replica = _kill_and_wait_failover(cluster, master)

    assert master.name not in cluster.roles()
    assert cluster.master_for_key(KEY) is replica
    client = cluster.client(decode_responses=True)  # a fresh client, seeded by the live nodes
    try:
        assert client.get(KEY) == "before-failover"
        assert client.set(KEY, "after-failover")
        assert client.get(KEY) == "after-failover"
    finally:
        client.close()


def test_restarted_master_rejoins_as_replica(cluster):
    master = _write_replicated(cluster, KEY, "v1")
    promoted = _kill_and_wait_failover(cluster, master)
    port, bus_port = master.port, master.bus_port

    master.start(timeout=30)
    assert (master.port, master.bus_port) == (port, bus_port)
    _poll(lambda: cluster.roles().get(master.name) == "replica", 30, f"{master.name} rejoined as replica")
    cluster.wait_healthy(timeout=30)
    assert cluster.replica_of(promoted) is master
    assert cluster.master_for_key(KEY) is promoted
    assert sorted(cluster.roles().values()) == ["master"] * 3 + ["replica"] * 3
    # It synced from the promoted node (wait_healthy saw its link up): what that holds, the
    # key written before the crash too.
    assert master.command("DBSIZE") == promoted.command("DBSIZE") == 1
