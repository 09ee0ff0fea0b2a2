"""A call on a Relay stream reads like the Generate call it replaces (pure logic, a fake link)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from ballast.v1 import common_pb2, worker_pb2
from services.common.accepted import was_accepted
from services.common.errors import Fault
from services.common.faults import classify, retry_after_hint
from services.common.generation import FinishReason
from services.router.events import Tokens, WorkerFinished
from services.router.relay_link import RelayCall


class FakeLink:
    def __init__(self) -> None:
        self.cancelled: list[int] = []
        self.forgotten: list[int] = []
        self.confirmed: list[int] = []

    def confirm(self, stream_id: int) -> None:
        self.confirmed.append(stream_id)

    def cancel(self, stream_id: int) -> None:
        self.cancelled.append(stream_id)

    def forget(self, stream_id: int) -> None:
        self.forgotten.append(stream_id)


def tokens(ids: list[int], first: int) -> worker_pb2.RelayEvent:
    return worker_pb2.RelayEvent(
        stream_id=1, tokens=common_pb2.Tokens(token_ids=ids, text="x" * len(ids), first_index=first)
    )


def finished() -> worker_pb2.RelayEvent:
    return worker_pb2.RelayEvent(
        stream_id=1,
        finished=worker_pb2.WorkerFinished(
            reason=common_pb2.FINISH_REASON_LENGTH, usage=common_pb2.Usage(prompt_tokens=5)
        ),
    )


def error(code: grpc.StatusCode, reason: str = "", retry_after_ms: int = 0) -> worker_pb2.RelayEvent:
    return worker_pb2.RelayEvent(
        stream_id=1,
        error=worker_pb2.RelayError(code=code.value[0], message="why", reason=reason, retry_after_ms=retry_after_ms),
    )


def new_call(link: FakeLink, deadline_s: float = 60.0, confirm: bool = False) -> RelayCall:
    return RelayCall(link, 1, time.monotonic() + deadline_s, confirm)  # type: ignore[arg-type]


async def drain(call: RelayCall) -> list:
    return [event async for event in call]


async def test_tokens_then_finished_end_the_iteration_and_the_call_leaves_the_link():
    link = FakeLink()
    call = new_call(link)
    call.deliver(tokens([1, 2], 0))
    call.deliver(tokens([3], 2))
    call.deliver(finished())
    assert await drain(call) == [
        Tokens("xx", [1, 2], 0),
        Tokens("x", [3], 2),
        WorkerFinished(FinishReason.LENGTH, 5),
    ]
    assert link.forgotten == [1] and call.done()
    # Cancelling an ended call is a no-op, as on a gRPC call.
    assert call.cancel() is False and link.cancelled == []


async def test_an_error_event_is_the_status_generate_would_have_ended_with():
    call = new_call(FakeLink())
    call.deliver(tokens([1], 0))
    call.deliver(error(grpc.StatusCode.RESOURCE_EXHAUSTED, Fault.OVERLOADED.value, retry_after_ms=500))
    iterator = aiter(call)
    assert await anext(iterator) == Tokens("x", [1], 0)
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await anext(iterator)
    assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert classify(ended.value).fault is Fault.OVERLOADED
    assert retry_after_hint(ended.value) == 0.5


async def test_a_draining_workers_error_reads_as_draining_not_unreachable():
    call = new_call(FakeLink())
    call.deliver(error(grpc.StatusCode.UNAVAILABLE, Fault.DRAINING.value))
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await drain(call)
    assert classify(ended.value).fault is Fault.DRAINING


async def test_a_broken_link_delivers_what_came_and_then_reads_as_an_unreachable_worker():
    call = new_call(FakeLink())
    call.deliver(tokens([4], 0))
    call.fail(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"))
    iterator = aiter(call)
    assert await anext(iterator) == Tokens("x", [4], 0)
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await anext(iterator)
    assert classify(ended.value).fault is Fault.UNREACHABLE


async def test_cancel_stops_the_request_and_a_waiting_reader_gets_cancelled_error():
    link = FakeLink()
    call = new_call(link)
    reader = asyncio.create_task(drain(call))
    await asyncio.sleep(0)  # the reader now waits for an event
    assert call.cancel() is True
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert link.cancelled == [1] and link.forgotten == [1]
    # Events that come after the cancel are dropped.
    call.deliver(tokens([1], 0))
    with pytest.raises(asyncio.CancelledError):
        await drain(call)


async def test_a_passed_deadline_ends_the_call_and_the_request_on_the_worker():
    link = FakeLink()
    call = new_call(link, deadline_s=-1.0)
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await drain(call)
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert link.cancelled == [1]


async def test_accepted_reads_as_the_accepted_header():
    call = new_call(FakeLink())
    assert await was_accepted(call) is False
    call.deliver(worker_pb2.RelayEvent(stream_id=1, accepted=worker_pb2.RelayAccepted()))
    assert await was_accepted(call) is True


ACCEPTED = worker_pb2.RelayEvent(stream_id=1, accepted=worker_pb2.RelayAccepted())


async def test_a_call_that_asks_for_it_confirms_the_accepted_event_it_read():
    link = FakeLink()
    call = new_call(link, confirm=True)
    assert link.confirmed == []
    call.deliver(ACCEPTED)
    # Read and recorded before the worker hears back: a loss after it is one taken on.
    assert link.confirmed == [1] and await was_accepted(call) is True


async def test_no_confirm_unasked_nor_for_a_call_already_ended():
    plain = FakeLink()
    new_call(plain).deliver(ACCEPTED)
    assert plain.confirmed == []
    ended = FakeLink()
    call = new_call(ended, confirm=True)
    call.cancel()
    call.deliver(ACCEPTED)
    assert ended.confirmed == []
