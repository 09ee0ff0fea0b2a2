"""Each etcd watch on a stream of its own, against a real etcd: events in order, one watch's end
leaving the others, and every way a watch can be lost (etcd stopped, a member that refuses or
never answers, a compacted revision) raised as an etcd error rather than left waiting; a watch
whose client is closed under it ends, so its owner reads again."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest
from aetcd.exceptions import RevisionCompactedError

from services.common.config import EtcdConfig
from services.common.etcd_client import make_client
from services.common.etcd_session import ETCD_ERRORS
from services.common.etcd_watch_stream import WatchLost

# A bound on each wait, so a watch that hangs fails the test instead of stalling the suite.
BOUND_S = 30.0


def config_of(server, **overrides) -> EtcdConfig:
    return EtcdConfig(host=server.host, port=server.port, timeout_s=2.0, **overrides)


async def next_event(watch):
    return await asyncio.wait_for(anext(aiter(watch)), BOUND_S)


async def test_watches_on_one_client_each_get_their_events_and_ending_one_leaves_the_others(etcd_server):
    prefix = f"/watch-stream-{uuid.uuid4().hex[:8]}/".encode()
    client = make_client(config_of(etcd_server))
    try:
        await client.connect()
        ours = await client.watch_prefix(prefix + b"a/")
        others = await client.watch_prefix(prefix + b"b/")
        doomed = await client.watch(prefix + b"b/x")
        await doomed.cancel()

        await client.put(prefix + b"a/1", b"one")
        await client.put(prefix + b"b/x", b"two")
        await client.delete(prefix + b"a/1")
        ours_events = aiter(ours)
        first = await asyncio.wait_for(anext(ours_events), BOUND_S)
        second = await asyncio.wait_for(anext(ours_events), BOUND_S)
        assert (first.kind, first.kv.key, first.kv.value) == ("PUT", prefix + b"a/1", b"one")
        assert (second.kind, second.kv.key) == ("DELETE", prefix + b"a/1")
        event = await next_event(others)
        assert (event.kind, event.kv.key, event.kv.value) == ("PUT", prefix + b"b/x", b"two")
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(aiter(doomed)), BOUND_S)
        await ours.cancel()
        await others.cancel()
    finally:
        await client.close()


async def test_a_watch_from_a_revision_replays_what_was_written_since(etcd_server):
    key = f"/watch-stream-{uuid.uuid4().hex[:8]}/k".encode()
    client = make_client(config_of(etcd_server))
    try:
        await client.connect()
        await client.put(key, b"1")
        written = await client.get(key)
        await client.put(key, b"2")
        watch = await client.watch(key, start_revision=written.mod_revision + 1)
        event = await next_event(watch)
        assert (event.kind, event.kv.value) == ("PUT", b"2")
        await watch.cancel()
    finally:
        await client.close()


async def test_a_watch_whose_client_is_closed_under_it_ends_instead_of_waiting(etcd_server):
    client = make_client(config_of(etcd_server))
    await client.connect()
    watch = await client.watch_prefix(f"/watch-stream-{uuid.uuid4().hex[:8]}/".encode())
    reading = asyncio.create_task(next_event(watch))
    await asyncio.sleep(0)  # the read is waiting on the stream
    await client.close()
    # Its owner sees the end and reads again on the session's next client.
    with pytest.raises(StopAsyncIteration):
        await reading


async def test_a_watch_of_an_etcd_that_stops_is_lost_and_a_new_one_follows_it_back(restartable_etcd):
    prefix = f"/watch-stream-{uuid.uuid4().hex[:8]}/".encode()
    client = make_client(config_of(restartable_etcd))
    await client.connect()
    await client.put(prefix + b"before", b"1")
    revision = (await client.get(prefix + b"before")).mod_revision
    watch = await client.watch_prefix(prefix, start_revision=revision + 1)
    reading = asyncio.create_task(next_event(watch))
    await asyncio.to_thread(restartable_etcd.stop)
    with pytest.raises(WatchLost):
        await reading
    await client.close()

    await asyncio.to_thread(restartable_etcd.restart)
    client = make_client(config_of(restartable_etcd))
    try:
        await asyncio.wait_for(until_it_answers(client), BOUND_S)
        await client.put(prefix + b"after", b"2")
        watch = await client.watch_prefix(prefix, start_revision=revision + 1)
        event = await next_event(watch)
        assert (event.kind, event.kv.key) == ("PUT", prefix + b"after")
        await watch.cancel()
    finally:
        await client.close()


async def until_it_answers(client) -> None:
    while True:
        try:
            await client.get(b"/")
            return
        except ETCD_ERRORS:
            await asyncio.sleep(0.1)


async def test_a_watch_from_a_compacted_revision_says_so(etcd_server):
    key = f"/watch-stream-{uuid.uuid4().hex[:8]}/k".encode()
    client = make_client(config_of(etcd_server))
    try:
        await client.connect()
        await client.put(key, b"1")
        first = (await client.get(key)).mod_revision
        await client.put(key, b"2")
        await client.compact((await client.get(key)).mod_revision)
        # etcd confirms the watch, then cancels it with the compaction's revision.
        with pytest.raises(RevisionCompactedError):
            await next_event(await client.watch(key, start_revision=first))
    finally:
        await client.close()


async def test_a_member_that_never_answers_fails_the_watch_instead_of_holding_it():
    # A listener that takes connections and never speaks: etcd's port with a hung process behind.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    host, port = silent.getsockname()
    client = make_client(EtcdConfig(host=host, port=port, timeout_s=1.0))
    try:
        await client.connect()
        with pytest.raises(WatchLost):
            await asyncio.wait_for(client.watch(b"/anything"), BOUND_S)
    finally:
        await client.close()
        silent.close()


async def test_a_member_that_refuses_the_connection_fails_the_watch_with_an_etcd_error():
    # A port nothing listens on: etcd's member gone. Every owner of a watch (the session's
    # prefix watches, the leader locks) handles the etcd errors and nothing else.
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    host, port = probe.getsockname()
    probe.close()
    client = make_client(EtcdConfig(host=host, port=port, timeout_s=1.0))
    try:
        await client.connect()
        with pytest.raises(ETCD_ERRORS) as lost:
            await asyncio.wait_for(client.watch(b"/anything"), BOUND_S)
        assert isinstance(lost.value, WatchLost)
    finally:
        await client.close()


class FreezingProxy:
    """A TCP relay to etcd that can go silent without closing anything: once `freeze()` is
    called it swallows every byte both ways, as a partition or a frozen host does."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._frozen = False
        self._server: asyncio.Server | None = None
        self._pumps: list[asyncio.Task] = []
        self._writers: list[asyncio.StreamWriter] = []
        self.connections = 0

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[:2]

    def freeze(self) -> None:
        self._frozen = True

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        self._writers.append(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            self._pumps.append(asyncio.create_task(self._pump(source, sink)))

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(65536):
            if not self._frozen:
                sink.write(data)
                await sink.drain()

    async def stop(self) -> None:
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_a_member_that_goes_silent_under_an_established_watch_fails_it(etcd_server):
    """The connection stays open and nothing comes back (no RST, no FIN): the channel's
    keepalive pings go unanswered and the watch fails with WatchLost, an etcd error, rather
    than waiting for events that will never come."""
    proxy = FreezingProxy(etcd_server.host, etcd_server.port)
    host, port = await proxy.start()
    prefix = f"/silent-{uuid.uuid4().hex[:8]}/".encode()
    through_proxy = make_client(EtcdConfig(host=host, port=port, timeout_s=2.0))
    direct = make_client(config_of(etcd_server))
    try:
        watch = await through_proxy.watch_prefix(prefix)
        await direct.put(prefix + b"before", b"1")
        event = await next_event(watch)
        assert event.kv.key == prefix + b"before"  # the watch is established and live
        proxy.freeze()
        await direct.put(prefix + b"after", b"2")
        with pytest.raises(WatchLost):
            # Up to two keepalive rounds (10 s + 10 s): a longer bound than the others.
            await asyncio.wait_for(anext(aiter(watch)), 2 * BOUND_S)
        assert proxy.connections == 1
    finally:
        await through_proxy.close()
        await direct.close()
        await proxy.stop()
