"""The one way Ballast opens an etcd client: one member or a cluster, plaintext or TLS, with
or without a user.

aetcd dials one plaintext address, so `EtcdClient` opens the same stubs itself: over TLS when
configured (server verified against `etcd.tls.ca_file`, the client certificate presented when
etcd checks them), and on one member of `etcd.endpoints`. Each new client starts at the next
member in turn and skips one that does not accept a connection; a call that fails makes the
session (`etcd_session.EtcdSession`) build a new client, which so moves to another member.
Each channel speaks to one member under that member's own name, so TLS verifies each member's
certificate as it is. Services reach etcd through `EtcdSession`, which alone calls `make_client`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aetcd
import grpc
from aetcd import rpc
from aetcd.client import _handle_errors

from services.common.config import BackingTLSConfig, EtcdConfig
from services.common.etcd_watch_stream import WatchStream


def _read_optional(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def tls_credentials(tls: BackingTLSConfig) -> grpc.ChannelCredentials:
    """Channel credentials from the files (read now: a client is rebuilt on every reconnect,
    so rotated files are picked up then)."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read_optional(tls.ca_file),
        private_key=_read_optional(tls.key_file),
        certificate_chain=_read_optional(tls.cert_file),
    )


# How long a new client waits for a member to accept a connection before trying the next.
MEMBER_CONNECT_TIMEOUT_S = 1.0

# HTTP/2 keepalive on the channel while it carries a call (a watch, a lease's keep-alive): a
# member that goes silent without closing the connection (a partition, a frozen host) fails
# the calls within about KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS instead of leaving a watch
# waiting for good. Every ping gets KEEPALIVE_TIMEOUT_MS for its answer, the flow-control
# pings gRPC sends on its own too (by default a minute, and a keepalive ping waits for one in
# flight); etcd answers pings from its transport, apart from raft and the disk, so only a
# process stopped that long misses one, and its 3-second leases have lapsed by then. etcd
# refuses pings closer than 5 s apart (--grpc-keepalive-min-time) and pings on a connection
# with no call (permit-without-stream off), so neither is asked of it; pings are not limited
# to two between data frames (an idle watch sends none).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 10_000
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
)

# Per endpoint list: the member the next client starts at (round robin over clients).
_next_member: dict[tuple[str, ...], int] = {}


def member_order(members: list[str]) -> list[str]:
    """Every member, starting at the next one in turn."""
    key = tuple(members)
    start = _next_member.get(key, 0) % len(members)
    _next_member[key] = start + 1
    return members[start:] + members[:start]


class EtcdClient(aetcd.Client):
    """aetcd's client on one of several members, over TLS when `credentials` are given."""

    def __init__(self, members: list[str], credentials: grpc.ChannelCredentials | None = None, **kwargs) -> None:
        host, _, port = members[0].rpartition(":")
        super().__init__(host=host, port=int(port), **kwargs)
        self._members = members
        self._credentials = credentials
        #: host:port of the member this client speaks to (once connected).
        self.member: str | None = None

    def _channel(self, member: str) -> grpc.aio.Channel:
        options = [*self._options.items(), *KEEPALIVE_OPTIONS]
        if self._credentials is not None:
            return grpc.aio.secure_channel(member, self._credentials, options=options)
        return grpc.aio.insecure_channel(member, options=options)

    async def _open_channel(self) -> grpc.aio.Channel:
        """A channel to the first member in turn that accepts a connection (with one member,
        that member, unchecked: its calls say if it is away)."""
        if len(self._members) == 1:
            self.member = self._members[0]
            return self._channel(self.member)
        candidates = member_order(self._members)
        for member in candidates:
            channel = self._channel(member)
            try:
                await asyncio.wait_for(channel.channel_ready(), MEMBER_CONNECT_TIMEOUT_S)
            except asyncio.TimeoutError:
                await channel.close()
                continue
            self.member = member
            return channel
        # None answers now: take the first anyway; its calls fail until one is back.
        self.member = candidates[0]
        return self._channel(self.member)

    @_handle_errors
    async def connect(self) -> None:
        # The same steps as aetcd's connect(), on a channel of our own.
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = await self._open_channel()
            if self._username is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                reply = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout
                )
                self.metadata = (("token", reply.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self.watchstub = rpc.WatchStub(self.channel)
            # No shared aetcd Watcher: each watch has a stream of its own (`watch` below).
            self._watcher = None
            self._connected.set()
        finally:
            self._is_connecting = False

    async def watch(  # type: ignore[override]
        self, key: bytes, range_end: bytes | None = None, start_revision: int | None = None
    ) -> WatchStream:
        """A watch of `key` (or of `[key, range_end)`) from `start_revision`, on a stream of
        its own, confirmed by etcd before it is returned."""
        await self.connect()
        watch = WatchStream(self.watchstub, key, range_end, start_revision, self.metadata, self._timeout)
        return await watch.open()

    async def watch_prefix(  # type: ignore[override]
        self, key_prefix: bytes, start_revision: int | None = None
    ) -> WatchStream:
        """A watch of every key under `key_prefix`, as `watch`."""
        return await self.watch(
            key_prefix, range_end=aetcd.utils.prefix_range_end(key_prefix), start_revision=start_revision
        )


def make_client(config: EtcdConfig) -> aetcd.Client:
    """A client for `config`: its members, TLS when `etcd.tls.enabled`, a user when `etcd.username`."""
    return EtcdClient(
        config.members,
        tls_credentials(config.tls) if config.tls.enabled else None,
        username=config.username or None,
        password=config.password or None,
        # aetcd's timeout is whole seconds; round up so short configs still get a deadline.
        timeout=max(1, round(config.timeout_s + 0.49)),
    )
