"""The engine's progress on a Relay stream (pure logic: a fake engine, a fake worker stream).

The worker reports its engine's steps to a router only for an interval in which the engine
moved, the router's requests got no token and some are on the stream; the router's link keeps
when the last report came, which its calls read."""

from __future__ import annotations

import asyncio
import time

from ballast.v1 import common_pb2, worker_pb2
from services.router.relay_link import RelayLink, engine_moved_at
from services.worker.relay import Outbox, RelayCounts
from services.worker.relay_progress import ProgressReporter


class FakeEngine:
    def __init__(self) -> None:
        self.steps = 0


async def sent(outbox: Outbox) -> list[worker_pb2.RelayEvents]:
    """The messages the outbox has ready now."""
    messages = outbox.messages()
    taken: list[worker_pb2.RelayEvents] = []
    outbox.stop()
    async for message in messages:
        taken.append(message)
    return taken


async def test_a_report_only_when_the_engine_moved_no_token_went_out_and_requests_wait():
    engine, outbox = FakeEngine(), Outbox(RelayCounts())
    busy = True
    reporter = ProgressReporter(engine, outbox, lambda: busy)
    assert not reporter.tick()  # the engine stood still
    engine.steps = 3
    assert reporter.tick()  # moved, nothing relayed: reported
    engine.steps = 5
    outbox.post_tokens(7, common_pb2.Tokens(token_ids=[1], text="a"), 0.0)
    assert not reporter.tick()  # a token went out: the router knows the worker lives
    engine.steps = 6
    busy = False
    assert not reporter.tick()  # no request of this router on the stream: nothing to tell
    busy = True
    engine.steps = 9
    assert reporter.tick()
    messages = await sent(outbox)
    reports = [m.engine.steps for m in messages if m.HasField("engine")]
    assert reports == [9]  # the later report replaced the earlier one not yet written
    assert [e.stream_id for m in messages for e in m.events] == [7]


async def test_a_report_leaves_alone_when_no_event_is_due():
    engine, outbox = FakeEngine(), Outbox(RelayCounts())
    reporter = ProgressReporter(engine, outbox, lambda: True)
    engine.steps = 1
    assert reporter.tick()
    [message] = await sent(outbox)
    assert message.engine.steps == 1 and not message.events


class FakeWorkerStream:
    def __init__(self) -> None:
        self.incoming: asyncio.Queue[worker_pb2.RelayEvents | None] = asyncio.Queue()
        self.written: list[worker_pb2.RelayActions] = []

    async def write(self, message: worker_pb2.RelayActions) -> None:
        self.written.append(message)

    def cancel(self) -> None:
        self.incoming.put_nowait(None)

    def __aiter__(self) -> "FakeWorkerStream":
        return self

    async def __anext__(self) -> worker_pb2.RelayEvents:
        message = await self.incoming.get()
        if message is None:
            raise StopAsyncIteration
        return message


class FakeStub:
    def __init__(self) -> None:
        self.stream = FakeWorkerStream()

    def Relay(self) -> FakeWorkerStream:
        return self.stream


async def until(condition) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)


async def test_the_link_keeps_when_the_worker_last_said_its_engine_moved():
    stub = FakeStub()
    link = RelayLink(stub, "w:1", on_closed=lambda _link: None)  # type: ignore[arg-type]
    try:
        call = link.start(worker_pb2.WorkerGenerateRequest(request_id="r"), time.monotonic() + 60, {})
        assert call.engine_moved_at is None and engine_moved_at(call) is None
        accepted = worker_pb2.RelayEvent(stream_id=call.stream_id, accepted=worker_pb2.RelayAccepted())
        stub.stream.incoming.put_nowait(worker_pb2.RelayEvents(events=[accepted]))
        await until(lambda: link._counts.messages_in == 1)
        assert link.engine_moved_at is None  # an event is no word on the engine
        before = time.monotonic()
        report = worker_pb2.RelayEvents()
        report.engine.steps = 12
        stub.stream.incoming.put_nowait(report)
        await until(lambda: link.engine_moved_at is not None)
        assert before <= call.engine_moved_at <= time.monotonic()  # type: ignore[operator]
        assert engine_moved_at(call) == link.engine_moved_at
        assert engine_moved_at(object()) is None  # a Generate call carries no report
    finally:
        await link.close()
