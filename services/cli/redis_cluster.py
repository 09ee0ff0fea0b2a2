"""A local Redis Cluster (Valkey nodes on loopback) for development and integration tests.

`LocalRedisCluster` starts `masters * (1 + replicas_per_master)` Valkey processes in cluster
mode, each a `ClusterNode` with its own port, cluster-bus port, data dir and log under
`state_dir`, and assembles them into one cluster: the 16384 hash slots split evenly over the
masters, every replica attached to its master. Clients such as redis-py's `RedisCluster` find
every node from any one of them (`url`, `startup_nodes`).

The assembly is done with plain cluster commands sent by redis-py (SET-CONFIG-EPOCH,
ADDSLOTSRANGE, MEET, REPLICATE) rather than `valkey-cli --cluster create`: no second binary to
find, each step is waited for explicitly, and a step that does not converge fails with the
state it reached and the nodes' log tails instead of a hang.

Failover is left to the cluster itself, as in production: a master killed with SIGKILL
(`ClusterNode.kill()`) is declared failed after the node timeout (2 s by default) and its
replica is promoted; started again (`ClusterNode.start()`, same ports and data dir, so the
same identity from its nodes.conf) it rejoins as a replica of the promoted node.

Cost: one process per node, about 10 MB of memory each at rest (6 processes for the default
3 masters with 1 replica each), no persistence (`--save "" --appendonly no`). The host must
be an IP address: CLUSTER MEET does not take names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.cli.localservers import LocalServer, RedisServer, ServerGroup
from services.common.processes import free_ports

__all__ = ["ClusterNode", "LocalRedisCluster", "NodeEntry", "SLOTS", "parse_cluster_nodes"]

SLOTS = 16384
# Flags of a node that cannot serve anything (yet, or any more).
_UNUSABLE_FLAGS = frozenset({"fail", "fail?", "handshake", "noaddr"})


@dataclass(frozen=True)
class NodeEntry:
    """One line of CLUSTER NODES: a member as the node asked sees it."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    config_epoch: int
    slots: tuple[range, ...]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def usable(self) -> bool:
        return not (self.flags & _UNUSABLE_FLAGS)

    def serves(self, slot: int) -> bool:
        return any(slot in r for r in self.slots)


def parse_cluster_nodes(text: str) -> list[NodeEntry]:
    """The entries of a CLUSTER NODES reply (slots being migrated, "[...]", are left out)."""
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        address = fields[1].split("@")[0]
        slots = []
        for item in fields[8:]:
            if item.startswith("["):
                continue
            lo, _, hi = item.partition("-")
            slots.append(range(int(lo), int(hi or lo) + 1))
        entries.append(
            NodeEntry(
                fields[0],
                int(address.rsplit(":", 1)[1] or 0),
                frozenset(fields[2].split(",")),
                None if fields[3] == "-" else fields[3],
                int(fields[6]),
                tuple(slots),
            )
        )
    return entries


class ClusterNode(RedisServer):
    """One Valkey node in cluster mode; nodes.conf lives in its data dir, so a restarted node
    comes back with the same node id and rejoins the cluster."""

    def __init__(
        self,
        state_dir: Path,
        name: str,
        port: int,
        bus_port: int,
        host: str = "127.0.0.1",
        node_timeout_ms: int = 2000,
        maxmemory: int | None = None,
    ) -> None:
        super().__init__(state_dir, port, host, maxmemory=maxmemory)
        # An instance attribute: LocalServer names the data dir and log after it.
        self.name = name
        self.bus_port = bus_port
        self.node_timeout_ms = node_timeout_ms
        self._node_id: str | None = None

    def _argv(self, binary: str) -> list[str]:
        return super()._argv(binary) + [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            # Explicit: the default (port + 10000) may be taken, or in the ephemeral range.
            "--cluster-port",
            str(self.bus_port),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            # A replica may always take over, however long ago it last heard from its master.
            "--cluster-replica-validity-factor",
            "0",
            # Replicas sync at once instead of after Valkey's default 5 s batching delay.
            "--repl-diskless-sync-delay",
            "0",
            # ... and load it from the socket: no dump.rdb left for a restart to load.
            "--repl-diskless-load",
            "swapdb",
        ]

    def command(self, *args: object) -> Any:
        """Send one command over a fresh connection (no retries: a dead node fails at once)."""
        client = redis.Redis(
            host=self.host,
            port=self.port,
            decode_responses=True,
            socket_timeout=2.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            # Multi-word commands go as separate words: redis-py then returns the raw reply
            # instead of parsing it with its own CLUSTER callbacks.
            return client.execute_command(*args)
        finally:
            client.close()

    def node_id(self) -> str | None:
        """The cluster id (kept in nodes.conf across restarts); while down, the last one seen."""
        if self.alive():
            self._node_id = str(self.command("CLUSTER", "MYID"))
        return self._node_id

    def view(self) -> list[NodeEntry]:
        """The cluster as this node sees it."""
        return parse_cluster_nodes(str(self.command("CLUSTER", "NODES")))

    def myself(self) -> NodeEntry:
        return next(e for e in self.view() if "myself" in e.flags)

    def cluster_info(self) -> dict[str, str]:
        text = str(self.command("CLUSTER", "INFO"))
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def role(self) -> str:
        """ "master" or "replica", as the node itself says (ROLE)."""
        return "master" if self.command("ROLE")[0] == "master" else "replica"

    def master_link_up(self) -> bool:
        return self.command("INFO", "replication").get("master_link_status") == "up"

    def kill(self) -> None:
        """SIGKILL the node (a crash: no shutdown, no last words to the cluster)."""
        if self.process is not None:
            self.process.kill()


class LocalRedisCluster(ServerGroup):
    """A Valkey cluster of `masters` masters with `replicas_per_master` replicas each."""

    # A node restarting or just killed.
    transient_errors = (redis.RedisError, OSError)

    default_start_timeout = 60.0

    def __init__(
        self,
        state_dir: Path,
        masters: int = 3,
        replicas_per_master: int = 1,
        host: str = "127.0.0.1",
        node_timeout_ms: int = 2000,
        maxmemory: int | None = None,
    ) -> None:
        if masters < 1 or replicas_per_master < 0:
            raise ValueError("need at least one master and no negative replica count")
        self.state_dir = Path(state_dir)
        self.host = host
        count = masters * (1 + replicas_per_master)
        # Client and bus ports picked together, so no two of them come back equal.
        ports = free_ports(2 * count, host)
        self.nodes = [
            ClusterNode(
                self.state_dir, f"redis-node-{i}", ports[2 * i], ports[2 * i + 1], host, node_timeout_ms, maxmemory
            )
            for i in range(count)
        ]
        # The k-th node after the masters starts out as a replica of master k // replicas_per_master.
        self._initial_master = {r: self.nodes[i // replicas_per_master] for i, r in enumerate(self.nodes[masters:])}
        self._masters = self.nodes[:masters]

    @property
    def url(self) -> str:
        """The first node's URL: a cluster client discovers the others from it (while it is up)."""
        return self.nodes[0].url

    @property
    def startup_nodes(self) -> list[str]:
        return [n.address for n in self.nodes]

    def alive_nodes(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive()]

    def client(self, **kwargs: object) -> redis.cluster.RedisCluster:
        """A redis-py cluster client seeded with every node that is running now."""
        seeds = [redis.cluster.ClusterNode(n.host, n.port) for n in self.alive_nodes()]
        return redis.cluster.RedisCluster(startup_nodes=seeds, **kwargs)

    def servers(self) -> list[LocalServer]:
        return list(self.nodes)

    # -- lifecycle ---------------------------------------------------------------------------

    def launch(self) -> None:
        """Start every node's process without waiting (see wait_ready), as LocalServer does."""
        try:
            for node in self.nodes:
                # A new cluster each time: a nodes.conf from an earlier run would make the
                # nodes remember old peers and refuse ADDSLOTSRANGE.
                (node.data_dir / "nodes.conf").unlink(missing_ok=True)
                node.launch()
        except BaseException:
            self.stop(timeout=2.0)
            raise

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for every node, then assemble the cluster; on failure stop them all and raise."""
        deadline = time.monotonic() + (self.default_start_timeout if timeout is None else timeout)
        try:
            for node in self.nodes:
                node.wait_ready(max(deadline - time.monotonic(), 0.1))
            self._assign_slots()
            self._meet()
            self._wait_for("every node to know every other", self._unknown_peers, deadline)
            for replica, master in self._initial_master.items():
                replica.command("CLUSTER", "REPLICATE", master.node_id())
            self._wait_for("the cluster to be healthy", self._health_problem, deadline)
        except BaseException:
            self.stop(timeout=2.0)
            raise

    def _assign_slots(self) -> None:
        for i, master in enumerate(self._masters):
            # Distinct epochs up front, so the cluster need not resolve a collision first.
            master.command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            lo, hi = i * SLOTS // len(self._masters), (i + 1) * SLOTS // len(self._masters) - 1
            master.command("CLUSTER", "ADDSLOTSRANGE", lo, hi)

    def _meet(self) -> None:
        first = self.nodes[0]
        for node in self.nodes[1:]:
            node.command("CLUSTER", "MEET", first.host, first.port, first.bus_port)

    def _unknown_peers(self) -> str | None:
        for node in self.nodes:
            known = [e for e in node.view() if e.usable]
            if len(known) < len(self.nodes):
                return f"{node.name} knows {len(known)} of {len(self.nodes)} nodes"
        return None

    # -- state, read live ----------------------------------------------------------------------

    def roles(self) -> dict[str, str]:
        """Node name -> "master" or "replica", for every node that is running."""
        return {n.name: n.role() for n in self.alive_nodes()}

    def master_for_key(self, key: str) -> ClusterNode:
        """The running node that serves `key`'s slot as master, by its own account (the
        highest config epoch wins while a restarted old master still claims the slot)."""
        alive = self.alive_nodes()
        if not alive:
            raise RuntimeError("no node is running")
        slot = int(alive[0].command("CLUSTER", "KEYSLOT", key))
        claims = [
            (me.config_epoch, node) for node in alive for me in [node.myself()] if me.is_master and me.serves(slot)
        ]
        if not claims:
            raise RuntimeError(f"no running master serves slot {slot} (key {key!r})")
        return max(claims, key=lambda claim: claim[0])[1]

    def replica_of(self, master: ClusterNode) -> ClusterNode | None:
        """A running node that replicates `master` now (the first one, if several), or None."""
        master_id = master.node_id()
        return next((n for n in self.alive_nodes() if n is not master and n.myself().master_id == master_id), None)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until every running node says cluster_state:ok, sees every slot served by a
        running master, and (if a replica) has its link to its master up."""
        self._wait_for("the cluster to be healthy", self._health_problem, time.monotonic() + timeout)

    def _health_problem(self) -> str | None:
        alive = self.alive_nodes()
        if not alive:
            return "no node is running"
        alive_ports = {n.port for n in alive}
        for node in alive:
            state = node.cluster_info().get("cluster_state")
            if state != "ok":
                return f"{node.name} says cluster_state:{state}"
            served = sum(
                len(r) for e in node.view() if e.is_master and e.usable and e.port in alive_ports for r in e.slots
            )
            if served != SLOTS:
                return f"{node.name} sees {SLOTS - served} slots without a running master"
            if node.role() == "replica" and not node.master_link_up():
                return f"{node.name}'s link to its master is not up"
        return None
