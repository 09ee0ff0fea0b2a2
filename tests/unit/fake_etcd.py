"""An in-memory stand-in for the aetcd client an `EtcdSession` holds: keys, revisions and
watches, enough to test how the session's users share one client without an etcd.

`FakeEtcd` is the store (it outlives clients, as etcd outlives connections); each `FakeClient`
is one connection to it. Closing a client ends its watches without an error, as aetcd's
`close()` does, so a user of a dropped client sees its watch simply stop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KeyValue:
    key: bytes
    value: bytes
    lease: int = 0
    mod_revision: int = 0


@dataclass
class Event:
    kind: str  # "PUT" or "DELETE", as aetcd names them
    kv: KeyValue


@dataclass
class Header:
    revision: int


class Result(list):
    """What `get_prefix` answers: the key-values, and the read's revision in `header`."""

    def __init__(self, kvs: list[KeyValue], revision: int) -> None:
        super().__init__(kvs)
        self.header = Header(revision)


@dataclass
class FakeWatch:
    client: "FakeClient"
    start: bytes
    end: bytes | None  # None: the one key `start`
    start_revision: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False

    def covers(self, key: bytes) -> bool:
        return key == self.start if self.end is None else self.start <= key < self.end

    async def cancel(self) -> None:
        self.cancelled = True
        self.client.watches.discard(self)
        self.events.put_nowait(None)

    def __aiter__(self) -> "FakeWatch":
        return self

    async def __anext__(self) -> Event:
        event = await self.events.get()
        if event is None:
            raise StopAsyncIteration
        return event

    __hash__ = object.__hash__


class FakeEtcd:
    """The keys and their history; `client()` makes one connection."""

    def __init__(self) -> None:
        self.keys: dict[bytes, KeyValue] = {}
        self.revision = 1
        self.clients: list[FakeClient] = []

    def client(self, _config: Any = None) -> "FakeClient":
        client = FakeClient(self)
        self.clients.append(client)
        return client

    @property
    def open_clients(self) -> list["FakeClient"]:
        return [c for c in self.clients if not c.closed]

    def _publish(self, event: Event) -> None:
        for client in self.open_clients:
            for watch in list(client.watches):
                if watch.covers(event.kv.key):
                    watch.events.put_nowait(event)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.revision += 1
        kv = self.keys[key] = KeyValue(key, value, lease, self.revision)
        self._publish(Event("PUT", kv))

    def delete(self, key: bytes) -> None:
        if key in self.keys:
            self.revision += 1
            self.keys.pop(key)
            self._publish(Event("DELETE", KeyValue(key, b"", 0, self.revision)))


class FakeClient:
    def __init__(self, etcd: FakeEtcd) -> None:
        self.etcd = etcd
        self.watches: set[FakeWatch] = set()
        self.closed = False
        self.member = "fake:2379"

    async def connect(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True
        for watch in list(self.watches):
            watch.events.put_nowait(None)
        self.watches.clear()

    async def get_prefix(self, prefix: bytes) -> Result:
        kvs = [kv for key, kv in sorted(self.etcd.keys.items()) if key.startswith(prefix)]
        return Result(kvs, self.etcd.revision)

    async def get(self, key: bytes) -> KeyValue | None:
        return self.etcd.keys.get(key)

    async def put(self, key: bytes, value: bytes, lease: int | None = None) -> None:
        self.etcd.put(key, value, lease or 0)

    def _watch(self, start: bytes, end: bytes | None, start_revision: int) -> FakeWatch:
        watch = FakeWatch(self, start, end, start_revision)
        self.watches.add(watch)
        return watch

    async def watch_prefix(self, prefix: bytes, start_revision: int = 0) -> FakeWatch:
        return self._watch(prefix, prefix[:-1] + bytes([prefix[-1] + 1]), start_revision)

    async def watch(self, key: bytes, start_revision: int = 0) -> FakeWatch:
        return self._watch(key, None, start_revision)
