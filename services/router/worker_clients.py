"""One gRPC channel per worker address, opened lazily, closed once the worker has left; on it,
for a worker that serves it, one Relay stream carrying all of this router's calls to it.

Generate calls on these channels pass `trace_metadata()` themselves: the channel intercepts
unary calls only (`unary_client_interceptors`), keeping the relay's per-token path short.

A channel that still carries streams is kept even when its worker left the membership
(etcd may flap while the worker is fine); it is closed at a later sweep once idle.

`WorkerChannels` is what a worker call asks of them (a stub, the Relay stream, the channel
held in use): the generation runner, the model registry and rollouts' mirrored calls depend
on it alone, so unit tests run them against fake workers (tests/unit/test_failover_run.py).
"""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator, Protocol

import grpc

from ballast.v1 import worker_pb2_grpc
from services.common.grpc_tracing import unary_client_interceptors
from services.common.tls.credentials import open_channel
from services.common.tls.settings import TLSConfig
from services.router.relay_link import RelayCounts, RelayLink


class WorkerChannels(Protocol):
    """What a call to a worker needs of the router's connections to the workers."""

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """The worker's stub (for unary calls and Generate)."""
        ...

    def link(self, address: str) -> RelayLink:
        """The router's one Relay stream to the worker."""
        ...

    def in_use(self, address: str) -> AbstractContextManager[worker_pb2_grpc.WorkerStub]:
        """Holds the worker's channel open while a call lives."""
        ...


class WorkerClients:
    def __init__(self, tls: TLSConfig | None = None) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._active: Counter[str] = Counter()
        self._links: dict[str, RelayLink] = {}
        self.relay_counts = RelayCounts()

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(address, self._tls, interceptors=unary_client_interceptors())
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    def link(self, address: str) -> RelayLink:
        """The Relay stream to `address`, opened on first use and again after it broke."""
        link = self._links.get(address)
        if link is None or link.broken:
            link = self._links[address] = RelayLink(self.stub(address), address, self._link_closed, self.relay_counts)
        return link

    def relay_addresses(self) -> list[str]:
        """The workers this router has a live Relay stream to."""
        return [address for address, link in self._links.items() if not link.broken]

    def _link_closed(self, link: RelayLink) -> None:
        if self._links.get(link.address) is link:
            del self._links[link.address]

    @contextmanager
    def in_use(self, address: str) -> Iterator[worker_pb2_grpc.WorkerStub]:
        self._active[address] += 1
        try:
            yield self.stub(address)
        finally:
            self._active[address] -= 1
            if self._active[address] <= 0:
                del self._active[address]

    async def retain(self, addresses: set[str]) -> None:
        """Closes idle channels to addresses no longer in the membership."""
        for address in [a for a in self._channels if a not in addresses and not self._active.get(a)]:
            link = self._links.pop(address, None)
            if link is not None:
                await link.close()
            channel = self._channels.pop(address)
            self._stubs.pop(address, None)
            await channel.close(grace=None)

    async def close(self) -> None:
        for link in list(self._links.values()):
            await link.close()
        self._links.clear()
        for channel in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()
        self._stubs.clear()
