"""A local etcd cluster (several members on loopback) for development and integration tests.

`LocalEtcdCluster` starts `members` etcd processes (3 by default), each an `EtcdMember` with
its own client port, peer port, data dir (`state_dir/etcd-<i>`) and log (`etcd-<i>.log`),
bootstrapped together as one cluster. Clients take `endpoints` (every member's host:port) or,
when they read a single etcd, `address`. start() launches every member before waiting for
any: a member answers /health only once the cluster has a leader, which needs a quorum.

Failover is the cluster's own, as in production: SIGKILL the leader (`member.process.kill()`)
and the survivors elect a new one after the election timeout (1 s by default); `member.start()`
(same ports and data dir) brings it back, and it rejoins and catches up from the leader.
The cluster's start() keeps the members' data if the same membership wrote it (a whole-cluster
stop and start) and wipes it otherwise. Plaintext only (no TLS, no auth).
"""

from __future__ import annotations

import base64
import http.client
import shutil
import time
from pathlib import Path

from services.cli.localservers import EtcdServer, LocalServer, ProcessStartError, ServerGroup
from services.common.processes import free_ports

__all__ = ["EtcdMember", "LocalEtcdCluster", "NoLeaderError"]

CLUSTER_TOKEN = "ballast-local"
# Written in each member's data dir: the --initial-cluster its data belongs to.
_MEMBERSHIP_FILE = "ballast-initial-cluster"
# What a member that is down, restarting or between leaders may answer with.
_TRANSIENT = (OSError, ValueError, http.client.HTTPException, ProcessStartError)


class NoLeaderError(RuntimeError):
    """No running member knows of a leader (an election under way, or no quorum)."""


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class EtcdMember(EtcdServer):
    """One member of a multi-member etcd cluster (plaintext). `initial_cluster` is the
    "name=peer-url,..." list of every member (by default this one alone)."""

    # A member left without a quorum can take long (or forever) to exit on SIGTERM; its WAL is
    # fsynced on every commit, so the SIGKILL after this loses nothing.
    stop_timeout = 5.0

    def __init__(
        self,
        state_dir: Path,
        name: str,
        port: int,
        peer_port: int,
        host: str = "127.0.0.1",
        initial_cluster: str | None = None,
        cluster_token: str = CLUSTER_TOKEN,
    ) -> None:
        super().__init__(state_dir, port, host, peer_port=peer_port)
        # An instance attribute: LocalServer names the data dir and log after it.
        self.name = name
        self.cluster_token = cluster_token
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self._member_id: int | None = None

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def _argv(self, binary: str) -> list[str]:
        argv = super()._argv(binary)
        argv[argv.index("--name") + 1] = self.name
        argv[argv.index("--initial-cluster") + 1] = self.initial_cluster
        # --initial-cluster-state new (from EtcdServer) is ignored once the data dir holds a
        # member, so a restarted member rejoins with its data.
        return argv + ["--initial-cluster-token", self.cluster_token]

    def status(self) -> dict:
        """This member's maintenance status (JSON gateway): header.member_id, leader, ..."""
        return self._call("maintenance/status", {})

    def member_id(self, refresh: bool = True) -> int | None:
        """This member's id (fixed by its peer URL and the cluster token); while it is down,
        or with `refresh` off once known, the last one seen."""
        if self.alive() and (refresh or self._member_id is None):
            self._member_id = int(self.status()["header"]["member_id"])
        return self._member_id

    def healthy(self) -> bool:
        """/health says true: the member has a leader and serves requests."""
        return self._probe()

    def put(self, key: str | bytes, value: str | bytes) -> int:
        """Write one key through this member; return the new revision."""
        answer = self._call("kv/put", {"key": _b64(key), "value": _b64(value)})
        return int(answer["header"]["revision"])

    def get(self, key: str | bytes, serializable: bool = False) -> bytes | None:
        """Read one key through this member; `serializable` reads its local copy only."""
        answer = self._call("kv/range", {"key": _b64(key), "serializable": serializable})
        kvs = answer.get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None


class LocalEtcdCluster(ServerGroup):
    """`members` etcd members on `host`, bootstrapped together as one cluster."""

    # A member restarting or just killed: refused connections, a half answer, a gateway refusal.
    transient_errors = _TRANSIENT

    default_start_timeout = 60.0

    def __init__(self, state_dir: Path, members: int = 3, host: str = "127.0.0.1") -> None:
        if members < 1:
            raise ValueError("need at least one member")
        self.state_dir = Path(state_dir)
        self.host = host
        #: Seconds the last start() took from the first launch until the cluster was healthy.
        self.startup_s: float | None = None
        self._launched_at = 0.0
        # Client and peer ports picked together, so no two of them come back equal.
        ports = free_ports(2 * members, host)
        initial = ",".join(f"etcd-{i}=http://{host}:{ports[2 * i + 1]}" for i in range(members))
        self._members = [
            EtcdMember(self.state_dir, f"etcd-{i}", ports[2 * i], ports[2 * i + 1], host, initial)
            for i in range(members)
        ]

    @property
    def members(self) -> list[EtcdMember]:
        return list(self._members)

    @property
    def endpoints(self) -> list[str]:
        """Every member's client address, host:port."""
        return [m.address for m in self._members]

    @property
    def address(self) -> str:
        """The first member's host:port (for code that reads a single etcd)."""
        return self._members[0].address

    @property
    def port(self) -> int:
        return self._members[0].port

    def alive_members(self) -> list[EtcdMember]:
        return [m for m in self._members if m.alive()]

    def servers(self) -> list[LocalServer]:
        return list(self._members)

    # -- lifecycle ---------------------------------------------------------------------------

    def launch(self) -> None:
        """Start every member's process without waiting (see wait_ready)."""
        self._launched_at = time.monotonic()
        try:
            for m in self._members:
                self._reset_foreign_data(m)
                m.launch()
        except BaseException:
            self.stop(timeout=2.0)
            raise

    @staticmethod
    def _reset_foreign_data(member: EtcdMember) -> None:
        """Wipe a member's data unless this membership wrote it."""
        marker = member.data_dir / _MEMBERSHIP_FILE
        if marker.is_file() and marker.read_text() == member.initial_cluster:
            return
        shutil.rmtree(member.data_dir / "member", ignore_errors=True)
        member.data_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(member.initial_cluster)

    def wait_ready(self, timeout: float | None = None) -> float:
        """Wait until every member is healthy and all agree on a leader; return the seconds
        since launch. On failure stop them all and raise ProcessStartError."""
        deadline = time.monotonic() + (self.default_start_timeout if timeout is None else timeout)
        try:
            for m in self._members:
                m.wait_ready(max(deadline - time.monotonic(), 0.1))
            self._wait_for("the cluster to be healthy", self._health_problem, deadline)
            for m in self._members:
                m.member_id()  # cached: leader() can name a member after it is killed
        except BaseException:
            self.stop(timeout=2.0)
            raise
        self.startup_s = time.monotonic() - self._launched_at
        return self.startup_s

    # -- state, read live ----------------------------------------------------------------------

    def leader(self) -> EtcdMember:
        """The leader as the first running member that answers sees it (just after a kill,
        possibly still the dead one). Raises NoLeaderError if none answers with a leader."""
        problems = []
        for m in self.alive_members():
            try:
                leader_id = int(m.status().get("leader") or 0)
            except _TRANSIENT as e:
                problems.append(f"{m.name}: {type(e).__name__}: {e}")
                continue
            if not leader_id:
                problems.append(f"{m.name}: no leader")
                continue
            for candidate in self._members:
                if candidate.member_id(refresh=False) == leader_id:
                    return candidate
            raise RuntimeError(f"{m.name} names leader {leader_id:x}, which is no member here")
        raise NoLeaderError("; ".join(problems) or "no member is running")

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until every running member says /health true and names the same running leader."""
        self._wait_for("the cluster to be healthy", self._health_problem, time.monotonic() + timeout)

    def _health_problem(self) -> str | None:
        alive = self.alive_members()
        if not alive:
            return "no member is running"
        leaders = {}
        for m in alive:
            if not m.healthy():
                return f"{m.name} says /health false"
            leaders[m.name] = int(m.status().get("leader") or 0)
        if len(set(leaders.values())) != 1 or 0 in leaders.values():
            return f"no leader all running members agree on: {leaders}"
        leader_id = next(iter(leaders.values()))
        if not any(m.member_id(refresh=False) == leader_id for m in alive):
            return f"the leader {leader_id:x} is not a running member"
        return None
