"""One etcd watch on a Watch stream of its own.

aetcd multiplexes every watch of a client on one shared stream, fed through a bounded request
queue and guarded by two locks and a condition; when that stream fails, its own task shuts it
down under those locks. An etcd restart at the wrong moment could leave a watch opened on the
client afterwards waiting for a creation nothing would send: a router then kept its last
membership and never learned of a worker that joined later, with nothing in its logs.

`WatchStream` gives each watch a stream of its own on the client's channel: one create request,
the created reply read under a deadline, then events until the stream ends. Nothing is shared
between watches but the channel, so one watch's failure is that watch's alone, and ending a
watch is ending its call (etcd drops a watch with its stream). A stream that fails or that etcd
cancels raises `WatchLost`, an etcd error like the others (`ConnectionError`); a watch from a
compacted revision raises aetcd's `RevisionCompactedError`. A watch whose client is closed under
it (the session dropped the client after another part's failed call) ends, as aetcd's did: its
owner reads again on the next client without calling etcd lost. Every way, the owner reads again
and watches anew; no way leaves it waiting.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import grpc
from aetcd import rpc, rtypes
from aetcd.exceptions import RevisionCompactedError

from services.common.tasks import cancelled_from_outside


class WatchLost(ConnectionError):
    """The watch's stream failed, etcd ended it or cancelled the watch, or the client closed
    before etcd confirmed the watch."""


class WatchStream:
    """One watch of `[key, range_end)` from `start_revision`; opened by `open()`, iterated for
    aetcd `Event`s, ended by `cancel()`."""

    def __init__(
        self,
        stub: rpc.WatchStub,
        key: bytes,
        range_end: bytes | None,
        start_revision: int | None,
        metadata: Any,
        create_timeout_s: float,
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self._create_timeout_s = create_timeout_s
        request = rpc.WatchCreateRequest(key=key)
        if range_end is not None:
            request.range_end = range_end
        if start_revision is not None:
            request.start_revision = start_revision
        self._create = rpc.WatchRequest(create_request=request)
        self._call: Any = None
        self._events: AsyncIterator[rtypes.Event] | None = None
        self.watch_id: int | None = None

    async def open(self) -> "WatchStream":
        """Opens the stream and waits for etcd to confirm the watch (within the deadline: a
        stream that never answers is a lost one, never a silent one)."""
        self._call = self._stub.Watch(metadata=self._metadata)
        try:
            async with asyncio.timeout(self._create_timeout_s):
                await self._send_create()
                reply = await self._read()
                while reply is not None and not reply.created:  # nothing else comes first on it
                    reply = await self._read()
        except TimeoutError:
            self._end()
            raise WatchLost(f"etcd did not confirm a watch within {self._create_timeout_s:g} s") from None
        except BaseException:
            self._end()
            raise
        if reply is None:
            self._end()
            raise WatchLost("the etcd client was closed before etcd confirmed the watch")
        self._check_open(reply)
        self.watch_id = reply.watch_id
        return self

    async def _send_create(self) -> None:
        """Sends the create request; a member that refuses the connection fails it here."""
        try:
            await self._call.write(self._create)
        except grpc.aio.AioRpcError as exc:
            raise WatchLost(f"etcd watch stream failed: {exc.code().name}: {exc.details()}") from exc
        except asyncio.InvalidStateError:
            raise WatchLost("the etcd watch stream ended before the watch was sent") from None
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            raise WatchLost("the etcd client was closed before the watch was sent") from None

    async def _read(self) -> Any:
        """The next reply; None when the stream was closed under the watch (its client closed)."""
        try:
            reply = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise WatchLost(f"etcd watch stream failed: {exc.code().name}: {exc.details()}") from exc
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            return None  # cancelled under us, not our own stop
        if reply is grpc.aio.EOF:
            raise WatchLost("etcd ended the watch stream")
        return reply

    def _check_open(self, reply: Any) -> None:
        if reply.compact_revision:
            self._end()
            raise RevisionCompactedError(reply.compact_revision)
        if reply.canceled:
            self._end()
            raise WatchLost(f"etcd cancelled the watch: {reply.cancel_reason or 'no reason given'}")

    async def events(self) -> AsyncIterator[rtypes.Event]:
        """The watch's events, in order, until it is lost (`WatchLost`), cancelled, or its client
        closed (the iteration ends)."""
        while self._call is not None:
            reply = await self._read()
            if reply is None:
                self._end()
                return
            self._check_open(reply)
            for event in reply.events:
                yield rtypes.Event(event.type, event.kv)

    def __aiter__(self) -> AsyncIterator[rtypes.Event]:
        # One iteration per watch: a second `async for` goes on where the first left off,
        # never reading the stream beside it.
        if self._events is None:
            self._events = self.events()
        return self._events

    async def cancel(self) -> None:
        """Ends the watch (its stream); idempotent, never waits on etcd."""
        self._end()

    def _end(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
