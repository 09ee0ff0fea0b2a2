"""One `Worker/Relay` stream per worker, carrying all of this router's calls to it.

A call on a link is a `RelayCall`: it starts with a `RelayStart` action and reads its own
events, which the link's reader hands out by stream id. It behaves like the `Generate` call it
replaces, so the runner's failover, stall timeout, cancellation and poison containment read it
the same way:
- iterating yields the worker's events as plain values, and ends when the request finishes;
- a request the worker ends with an error raises that status as a `grpc.aio.AioRpcError`
  (with its `ballast-reason` and retry trailers), and so does a link that breaks, for every
  call on it (UNAVAILABLE without a reason: the worker is unreachable, as a broken channel is);
- `cancel()` stops the request on the worker, and a reader waiting on the call gets
  asyncio.CancelledError, as from a cancelled gRPC call;
- `initial_metadata()` carries the accepted header once the worker took the request on; a call
  started with `confirm_accepted` answers the worker's accepted event with a confirm, and the
  worker lets its engine see the request only then, so a worker that dies taking it on cannot
  take the accepted event down with it unread;
- past its deadline the call ends with DEADLINE_EXCEEDED, whatever the worker does;
- `engine_moved_at` says when the worker last reported that its engine computed steps while
  none of this router's requests got a token (services.worker.relay_progress): a first token's
  stall on a busy engine is then not held against the request.

Writes are batched the same way the worker batches its events: actions posted while a write
is in flight leave together in the next message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import grpc

from ballast.v1 import worker_pb2, worker_pb2_grpc
from services.common.accepted import ACCEPTED_METADATA
from services.common.faults import REASON_KEY, RETRY_AFTER_KEY
from services.router.events import Tokens, WorkerFinished
from services.router.events_pb import FINISH_FROM_PB

log = logging.getLogger(__name__)

_NO_METADATA = grpc.aio.Metadata()
_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def _status(code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, _NO_METADATA, grpc.aio.Metadata(*trailers), details=details)


def error_from_event(error: worker_pb2.RelayError) -> grpc.aio.AioRpcError:
    """A request's error event as the status its Generate call would have ended with."""
    trailers: list[tuple[str, str]] = []
    if error.reason:
        trailers.append((REASON_KEY, error.reason))
    if error.retry_after_ms:
        trailers.append((RETRY_AFTER_KEY, str(error.retry_after_ms)))
    code = _STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
    return _status(code, error.message, tuple(trailers))


@dataclass
class RelayCounts:
    """What this router's Relay streams carried: messages each way and the worker events in
    them (plain counts the metrics read)."""

    messages_in: int = 0
    events_in: int = 0
    messages_out: int = 0


class _Cancelled:
    """The end of a call this router cancelled."""


_CANCELLED = _Cancelled()


class RelayCall:
    """One request on a link; see the module docstring for how it behaves."""

    __slots__ = ("_link", "stream_id", "_events", "_waiter", "_end", "_accepted", "_confirm", "_deadline_timer")

    def __init__(self, link: "RelayLink", stream_id: int, deadline: float, confirm: bool = False) -> None:
        self._link = link
        self.stream_id = stream_id
        self._confirm = confirm
        self._events: deque[Tokens | WorkerFinished] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # None while the call runs; then StopAsyncIteration (finished), an AioRpcError or _CANCELLED.
        self._end: object | None = None
        self._accepted = False
        # The loop's clock is time.monotonic(), the clock of `deadline`.
        self._deadline_timer = asyncio.get_running_loop().call_at(deadline, self._deadline_passed)

    # -- the reader's side ----------------------------------------------------------------

    def deliver(self, event: worker_pb2.RelayEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "tokens":
            tokens = event.tokens
            self._events.append(Tokens(tokens.text, list(tokens.token_ids), tokens.first_index))
        elif kind == "finished":
            finished = event.finished
            self._events.append(WorkerFinished(FINISH_FROM_PB.get(finished.reason), finished.usage.prompt_tokens))
            self._close(StopAsyncIteration())
        elif kind == "accepted":
            self._accepted = True
            if self._confirm and self._end is None:
                self._link.confirm(self.stream_id)
            return
        elif kind == "error":
            self._close(error_from_event(event.error))
        else:
            return  # a newer worker's event this router does not know
        self._wake()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        """The link broke: the call ends with `error` after what it already holds."""
        self._close(error)
        self._wake()

    # -- the caller's side ----------------------------------------------------------------

    def __aiter__(self) -> "RelayCall":
        return self

    async def __anext__(self) -> Tokens | WorkerFinished:
        while not self._events:
            end = self._end
            if end is not None:
                if end is _CANCELLED:
                    raise asyncio.CancelledError()
                raise end  # type: ignore[misc]
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._events.popleft()

    def cancel(self) -> bool:
        """Stops the request on the worker; False when the call had already ended."""
        if self._end is not None:
            return False
        self._close(_CANCELLED)
        self._link.cancel(self.stream_id)
        self._wake()
        return True

    def done(self) -> bool:
        return self._end is not None

    @property
    def engine_moved_at(self) -> float | None:
        """When (time.monotonic()) the worker last reported its engine moving without a
        token for this router; None: never on this link."""
        return self._link.engine_moved_at

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata(*ACCEPTED_METADATA) if self._accepted else _NO_METADATA

    # -- inside ---------------------------------------------------------------------------

    def _deadline_passed(self) -> None:
        if self._end is None:
            self._close(_status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._link.cancel(self.stream_id)
            self._wake()

    def _close(self, end: object) -> None:
        if self._end is None:
            self._end = end
            self._deadline_timer.cancel()
            self._link.forget(self.stream_id)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class RelayLink:
    """The Relay stream to one worker address, its calls and its writer and reader tasks."""

    def __init__(
        self,
        stub: worker_pb2_grpc.WorkerStub,
        address: str,
        on_closed: Callable[["RelayLink"], None],
        counts: RelayCounts | None = None,
    ) -> None:
        self.address = address
        self._counts = counts or RelayCounts()
        self._on_closed = on_closed
        self._calls: dict[int, RelayCall] = {}
        self._ids = itertools.count(1)
        self._outbox: list[worker_pb2.RelayAction] = []
        self._ready = asyncio.Event()
        self._broken: grpc.aio.AioRpcError | None = None
        # When the worker last reported its engine's steps (RelayEvents.engine).
        self.engine_moved_at: float | None = None
        self._stream = stub.Relay()
        self._writer = asyncio.create_task(self._write(), name=f"relay-write {address}")
        self._reader = asyncio.create_task(self._read(), name=f"relay-read {address}")

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def start(
        self,
        request: worker_pb2.WorkerGenerateRequest,
        deadline: float,
        trace: dict[str, str],
        confirm_accepted: bool = False,
    ) -> RelayCall:
        """Starts `request` on the worker; `deadline`: time.monotonic() by which it must end.
        `confirm_accepted`: the worker waits for this router to have read its accepted event."""
        stream_id = next(self._ids)
        call = RelayCall(self, stream_id, deadline, confirm_accepted)
        if self._broken is not None:
            call.fail(self._broken)
            return call
        self._calls[stream_id] = call
        timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
        self._post(
            worker_pb2.RelayAction(
                stream_id=stream_id,
                start=worker_pb2.RelayStart(
                    request=request,
                    timeout_ms=min(timeout_ms, 0xFFFFFFFF),
                    traceparent=trace.get("traceparent", ""),
                    tracestate=trace.get("tracestate", ""),
                    confirm_accepted=confirm_accepted,
                ),
            )
        )
        return call

    def cancel(self, stream_id: int) -> None:
        if self._broken is None:
            self._post(worker_pb2.RelayAction(stream_id=stream_id, cancel=worker_pb2.RelayCancel()))

    def confirm(self, stream_id: int) -> None:
        if self._broken is None:
            self._post(worker_pb2.RelayAction(stream_id=stream_id, confirm=worker_pb2.RelayConfirm()))

    def forget(self, stream_id: int) -> None:
        self._calls.pop(stream_id, None)

    async def close(self) -> None:
        """Ends the stream and every call on it (their readers see the link broken)."""
        self._break(_status(grpc.StatusCode.UNAVAILABLE, f"relay to {self.address} closed"))
        self._stream.cancel()
        for task in (self._writer, self._reader):
            task.cancel()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)

    def _post(self, action: worker_pb2.RelayAction) -> None:
        self._outbox.append(action)
        self._ready.set()

    async def _write(self) -> None:
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                actions, self._outbox = self._outbox, []
                await self._stream.write(worker_pb2.RelayActions(actions=actions))
                self._counts.messages_out += 1
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as error:
            self._break(error)
        except Exception as error:  # the stream finished or failed under the write: the reader says why
            log.debug("relay to %s: write failed: %r", self.address, error)

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError
        try:
            counts = self._counts
            async for message in self._stream:
                calls = self._calls
                events = message.events
                counts.messages_in += 1
                counts.events_in += len(events)
                for event in events:
                    call = calls.get(event.stream_id)
                    if call is not None:
                        call.deliver(event)
                if message.HasField("engine"):
                    self.engine_moved_at = time.monotonic()
            error = _status(grpc.StatusCode.UNAVAILABLE, f"relay to {self.address} ended")
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as failure:
            error = failure
        except Exception as failure:
            log.warning("relay to %s failed: %r", self.address, failure)
            error = _status(grpc.StatusCode.UNAVAILABLE, f"relay to {self.address} failed")
        self._break(error)

    def _break(self, error: grpc.aio.AioRpcError) -> None:
        if self._broken is not None:
            return
        # Whatever ended the link, for its calls the worker is out of reach: UNAVAILABLE, no
        # reason (a link refused as a whole, say UNIMPLEMENTED, says nothing about a request).
        self._broken = _status(
            grpc.StatusCode.UNAVAILABLE, f"relay to {self.address}: {error.code().name}: {error.details()}"
        )
        log.info(
            "relay to %s ended: %s %s (%d calls on it)",
            self.address,
            error.code().name,
            error.details(),
            len(self._calls),
        )
        for call in list(self._calls.values()):
            call.fail(self._broken)
        self._calls.clear()
        self._on_closed(self)


def engine_moved_at(call: object) -> float | None:
    """`RelayCall.engine_moved_at` of a Relay call; None for a Generate call (or none)."""
    return call.engine_moved_at if isinstance(call, RelayCall) else None
