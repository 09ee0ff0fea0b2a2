"""`Worker/Relay` on the worker: one router's many requests over one stream.

Each start runs in a task of its own through the very code of `Generate` (validation,
admission, the accepted signal, the engine, the spans, the metrics, the stream interval), so a
request behaves the same whichever call carried it. What the tasks produce goes into one outbox;
a writer sends everything pending as one `RelayEvents` message, so a busy worker sends several
requests' tokens per message instead of a message per request.

Tokens after a request's first are held back for its stream interval as Generate holds them,
and leave early with another write once they have waited three quarters of it: the requests
fall into step, and a message carries the tokens of many of them (see `Outbox`). Tokens that
came further apart than the interval are not held (see `TokenPacer`): they leave with the
message of the wake-up that brought them.

A start's `accepted` event is written before its engine sees the request (the router's poison
containment counts a worker lost after it against the request), and an error ends one request
with Generate's status, as an event: the other requests on the stream go on. A start that asks
for it (`confirm_accepted`) waits, after its accepted event, for the router's `confirm`: a
worker that dies at once can take an accepted event the router had not read yet down with its
connection, and the router asks for the confirmation when it must know (a request that already
cost a worker).

While the router's requests wait on a busy engine without a token, the stream carries the
engine's step count (services.worker.relay_progress), so a slow first token is not taken for a
wedged worker.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncGenerator, AsyncIterator, Iterable, cast

import grpc
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, set_span_in_context

from ballast.v1 import common_pb2, worker_pb2
from services.common import tracing
from services.common.errors import BallastError, DeadlineExceeded, Fault
from services.common.faults import RETRY_AFTER_KEY, status_trailers
from services.common.grpc_tracing import SERVER_ERROR_CODES
from services.worker.engine import Stepping
from services.worker.relay_progress import ProgressReporter

if TYPE_CHECKING:
    from services.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)
TRACER = tracing.tracer("worker")
# The span of one relayed request: the worker's server span of the request, named and
# described as a Generate call's (traces and dashboards read both kinds the same), with
# `ballast.relay` set.
SPAN_NAME = "ballast.v1.Worker/Generate"
SPAN_ATTRIBUTES: dict[str, str | bool] = {
    "rpc.system": "grpc",
    "rpc.service": "ballast.v1.Worker",
    "rpc.method": "Generate",
    "ballast.relay": True,
}


@dataclass
class RelayCounts:
    """What this worker's Relay streams sent: messages, and the events in them (plain counts,
    read by the metrics; nothing on the hot path but two additions per message)."""

    messages: int = 0
    events: int = 0


def error_event(stream_id: int, error: BallastError) -> worker_pb2.RelayEvent:
    """A request's end with `error`: the status Generate would have answered, as an event."""
    trailers = dict(status_trailers(error))
    return worker_pb2.RelayEvent(
        stream_id=stream_id,
        error=worker_pb2.RelayError(
            code=error.code.value[0],
            message=error.message,
            reason=error.fault.value,
            retry_after_ms=int(trailers.get(RETRY_AFTER_KEY, 0)),
        ),
    )


class _StreamCall:
    """What Generate asks of its call, for one request of a Relay stream."""

    def __init__(self, outbox: "Outbox", stream_id: int, confirmed: asyncio.Future[None] | None) -> None:
        self._outbox = outbox
        self._stream_id = stream_id
        self._confirmed = confirmed

    async def send_initial_metadata(self, _metadata: Iterable[tuple[str, str]]) -> None:
        await self._outbox.post_and_flush(
            worker_pb2.RelayEvent(stream_id=self._stream_id, accepted=worker_pb2.RelayAccepted())
        )
        if self._confirmed is not None:
            # Bounded by the request's deadline and ended by its cancel, as the request is.
            await self._confirmed


class _Held:
    """A request's tokens held back, merged into one event, and when they must leave."""

    __slots__ = ("event", "due", "ripe")

    def __init__(self, event: worker_pb2.RelayEvent, due: float, hold_s: float) -> None:
        self.event = event
        self.due = due
        # From here on they leave with any write: the last quarter of their interval.
        self.ripe = due - hold_s / 4


class TokenPacer:
    """How long a request's tokens may wait for its next ones, as they come.

    The first never waits. Nor do tokens that came further apart from the ones before than
    the interval: holding them merges nothing with the next ones (they come after the hold is
    up), it only moves their write out of the wake-up that brought them into a timer's of its
    own, and a process woken for one small write pays several times what that write costs
    while it is awake anyway (a gRPC message alone: about 0.4 CPU-ms against 0.08 back to back,
    measured on two cores). Such tokens leave with the message of the wake-up that brought
    them, beside every other request's tokens that came with it (an engine step's).
    """

    __slots__ = ("interval_s", "_loop", "_last")

    def __init__(self, interval_s: float, loop: asyncio.AbstractEventLoop) -> None:
        self.interval_s = interval_s
        self._loop = loop
        self._last: float | None = None

    def hold_s(self) -> float:
        """The hold of tokens that came now (0: send them with this wake-up's message)."""
        now, last = self._loop.time(), self._last
        self._last = now
        if last is None or now - last >= self.interval_s:
            return 0.0
        return self.interval_s


class Outbox:
    """Events waiting for the stream, written as one message per write.

    A request's first token, its end, an accept and an error leave at once. Its later tokens
    are held back for the hold they are posted with (its stream interval, as Generate holds
    them; none for tokens `TokenPacer` lets go), merged into one event; they leave when it is
    up, or with any earlier write once they have waited three quarters of it. So the requests
    on a stream fall into step and one message carries the tokens of many of them, while each
    request still gets its tokens in messages its interval apart at most, never held longer
    than its interval.
    """

    def __init__(self, counts: RelayCounts) -> None:
        self._counts = counts
        self._loop = asyncio.get_running_loop()
        self._now: list[worker_pb2.RelayEvent] = []
        self._held: dict[int, _Held] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._flushed: list[asyncio.Future[None]] = []
        self._ready = asyncio.Event()
        self._stopping = False
        # Token events posted (the engine-progress report leaves the stream alone while they come).
        self.tokens_posted = 0
        # The engine's step count to report with the next message (services.worker.relay_progress).
        self._progress: int | None = None

    def post(self, event: worker_pb2.RelayEvent) -> None:
        """Sends `event` now, after the request's held tokens (an end follows its tokens)."""
        held = self._held.pop(event.stream_id, None)
        if held is not None:
            self._now.append(held.event)
        self._now.append(event)
        self._ready.set()

    def post_tokens(self, stream_id: int, tokens: common_pb2.Tokens, hold_s: float) -> None:
        """Sends `tokens` within `hold_s` (0: now), merged with the request's held tokens."""
        self.tokens_posted += 1
        held = self._held.get(stream_id)
        if held is not None:
            held.event.tokens.token_ids.extend(tokens.token_ids)
            held.event.tokens.text += tokens.text
            return
        event = worker_pb2.RelayEvent(stream_id=stream_id, tokens=tokens)
        if hold_s <= 0:
            self._now.append(event)
            self._ready.set()
            return
        due = self._loop.time() + hold_s
        self._held[stream_id] = _Held(event, due, hold_s)
        if due < self._timer_at:
            self._wake_at(due)

    def post_progress(self, steps: int) -> None:
        """Sends the engine's step count now, with whatever else is due."""
        self._progress = steps
        self._ready.set()

    async def post_and_flush(self, event: worker_pb2.RelayEvent) -> None:
        """Posts `event` and returns once it is written (raises CancelledError when the stream ends first)."""
        flushed = self._loop.create_future()
        self._flushed.append(flushed)
        self.post(event)
        await flushed

    def _wake_at(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._ready.set)

    def _take(self) -> list[worker_pb2.RelayEvent]:
        """What leaves now: everything due now, and the held tokens that are ripe."""
        events, self._now = self._now, []
        if self._held:
            now = self._loop.time()
            ripe = [stream_id for stream_id, held in self._held.items() if held.ripe <= now]
            for stream_id in ripe:
                events.append(self._held.pop(stream_id).event)
        next_due = min((held.due for held in self._held.values()), default=math.inf)
        if next_due != self._timer_at:
            if next_due == math.inf:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer, self._timer_at = None, math.inf
            else:
                self._wake_at(next_due)
        return events

    async def messages(self) -> AsyncIterator[worker_pb2.RelayEvents]:
        """What is due, a message at a time, until `stop()` (then everything left)."""
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if self._stopping:
                    for held in self._held.values():
                        held.ripe = -math.inf
                events = self._take()
                progress, self._progress = self._progress, None
                if events or progress is not None:
                    flushed, self._flushed = self._flushed, []
                    message = worker_pb2.RelayEvents(events=events)
                    if progress is not None:
                        message.engine.steps = progress
                    # Resumes once gRPC took the message (as an awaited write would).
                    yield message
                    self._counts.messages += 1
                    self._counts.events += len(events)
                    for waiter in flushed:
                        if not waiter.done():
                            waiter.set_result(None)
                if self._stopping and not self._now and not self._held:
                    return
        finally:
            if self._timer is not None:
                self._timer.cancel()
            for waiter in self._flushed:
                waiter.cancel()

    def stop(self) -> None:
        """Lets `messages` end once everything pending is out."""
        self._stopping = True
        self._ready.set()


class RelayStream:
    """One Relay call on the worker: its requests' tasks and its outbox."""

    def __init__(self, servicer: "WorkerServicer") -> None:
        self._servicer = servicer
        self._outbox = Outbox(servicer.relay_counts)
        self._tasks: dict[int, asyncio.Task[None]] = {}
        # Starts waiting for the router's confirm of their accepted event, by stream id.
        self._confirms: dict[int, asyncio.Future[None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._winding_down: asyncio.Future[None] | None = None

    async def serve(self, actions: AsyncIterator[worker_pb2.RelayActions]) -> AsyncIterator[worker_pb2.RelayEvents]:
        """The stream's messages, until the router ends it or `close()`; a frame that does not
        parse ends it with that error (as the call's status)."""
        reader = asyncio.create_task(self._read(actions))
        self._reader = reader
        reader.add_done_callback(lambda _reader: self._wind_down_soon())
        progress = self._report_progress()
        try:
            async for message in self._outbox.messages():
                yield message
            if not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
        finally:
            reader.cancel()
            if progress is not None:
                progress.cancel()
            # The router went away: nobody is left to read these answers.
            await self._stop_requests()

    def _report_progress(self) -> asyncio.Task[None] | None:
        """The task telling the router the engine moved while its requests got no token
        (services.worker.relay_progress); None for an engine that does not count its steps."""
        engine, interval_s = self._servicer.engine, self._servicer.engine_progress_s
        if not isinstance(engine, Stepping) or interval_s <= 0:
            return None
        reporter = ProgressReporter(engine, self._outbox, lambda: bool(self._tasks))
        return asyncio.create_task(reporter.run(interval_s), name="relay-engine-progress")

    def _wind_down_soon(self) -> None:
        self._winding_down = asyncio.ensure_future(self._wind_down())

    async def _wind_down(self) -> None:
        """The actions ended (or `close()`): stops the requests still running, then lets what
        they said last (a drained request's hand-off among them) go out, and the stream end."""
        await self._stop_requests()
        self._outbox.stop()

    async def _stop_requests(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Ends the stream with OK (the worker is stopping, its requests already drained), so
        the server's stop need not wait for the router to hang up."""
        if self._reader is not None:
            self._reader.cancel()

    async def _read(self, actions: AsyncIterator[worker_pb2.RelayActions]) -> None:
        async for message in actions:
            for action in message.actions:
                kind = action.WhichOneof("action")
                if kind == "start":
                    self._start(action.stream_id, action.start)
                elif kind == "cancel":
                    self._cancel(action.stream_id)
                elif kind == "confirm":
                    self._confirm(action.stream_id)

    def _start(self, stream_id: int, start: worker_pb2.RelayStart) -> None:
        if stream_id in self._tasks:
            # A router reusing a live id would mix two requests' tokens: refuse the newcomer.
            self._outbox.post(error_event(stream_id, DuplicateStream(f"stream {stream_id} is already running")))
            return
        confirmed: asyncio.Future[None] | None = None
        if start.confirm_accepted:
            confirmed = asyncio.get_running_loop().create_future()
            self._confirms[stream_id] = confirmed
        task = asyncio.create_task(self._run(stream_id, start, confirmed))
        self._tasks[stream_id] = task
        task.add_done_callback(lambda _task: self._ended(stream_id))

    def _ended(self, stream_id: int) -> None:
        self._tasks.pop(stream_id, None)
        self._confirms.pop(stream_id, None)

    def _cancel(self, stream_id: int) -> None:
        task = self._tasks.get(stream_id)
        if task is not None:
            task.cancel()

    def _confirm(self, stream_id: int) -> None:
        # None: a confirm for a request that did not ask for one, or has ended: nothing to do.
        confirmed = self._confirms.pop(stream_id, None)
        if confirmed is not None and not confirmed.done():
            confirmed.set_result(None)

    async def _run(self, stream_id: int, start: worker_pb2.RelayStart, confirmed: asyncio.Future[None] | None) -> None:
        parent = tracing.context_from_headers(
            [(tracing.TRACEPARENT, start.traceparent), ("tracestate", start.tracestate)]
        )
        span = TRACER.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER, attributes=SPAN_ATTRIBUTES)
        token = otel_context.attach(set_span_in_context(span, parent))
        code: grpc.StatusCode = grpc.StatusCode.OK
        failure: BaseException | None = None
        try:
            timeout = start.timeout_ms / 1000 if start.timeout_ms else None
            try:
                async with asyncio.timeout(timeout):
                    await self._relay(stream_id, start.request, confirmed)
            except TimeoutError:
                raise DeadlineExceeded("deadline exceeded while generating") from None
        except BallastError as error:
            code, failure = error.code, error
            self._outbox.post(error_event(stream_id, error))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as bug:
            log.exception("bug relaying stream %d", stream_id)
            internal = RelayBug("internal error in ballast.v1.Worker/Relay")
            code, failure = internal.code, bug
            self._outbox.post(error_event(stream_id, internal))
        finally:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            # Like a Generate call's span: only the server's own failures mark it failed.
            tracing.end_span(span, failure if code in SERVER_ERROR_CODES else None)
            otel_context.detach(token)

    async def _relay(
        self, stream_id: int, request: worker_pb2.WorkerGenerateRequest, confirmed: asyncio.Future[None] | None
    ) -> None:
        # Generate yields tokens as they come; the outbox holds them for the request's interval.
        hold_s = self._servicer.flush_interval_s(request)
        events = cast(
            AsyncGenerator[worker_pb2.WorkerGenerateEvent, None],
            self._servicer.Generate(request, _StreamCall(self._outbox, stream_id, confirmed), hold=False),  # type: ignore[arg-type]
        )
        pacer = TokenPacer(hold_s, asyncio.get_running_loop())
        try:
            async for event in events:
                if event.HasField("tokens"):
                    self._outbox.post_tokens(stream_id, event.tokens, pacer.hold_s())
                else:
                    self._outbox.post(worker_pb2.RelayEvent(stream_id=stream_id, finished=event.finished))
        finally:
            await events.aclose()


class DuplicateStream(BallastError):
    """A start reused the id of a request still running on the stream."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    fault = Fault.INVALID_ARGUMENT


class RelayBug(BallastError):
    """Anything but a typed error escaped a relayed request: a bug, answered as INTERNAL."""

    code = grpc.StatusCode.INTERNAL
