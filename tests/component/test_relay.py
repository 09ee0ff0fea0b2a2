"""Worker/Relay against a real worker and router (in process, real etcd, port 0): many requests
over one stream, each behaving as its own Generate call would."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from ballast.v1 import common_pb2, inference_pb2_grpc, worker_pb2
from services.cli.client import chat_request, collect
from services.common.faults import classify
from services.common.errors import Fault
from services.router.app import create_server as create_router
from services.worker.app import create_server as create_worker
from tests.component.conftest import API_KEY, make_config
from tests.served import assert_served

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "Where is my order? I paid for a blue phone case yesterday."


def _request(worker_app, max_tokens: int, prompt: str = PROMPT) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=uuid.uuid4().hex,
        tenant="acme",
        prompt_ids=worker_app.engine.tokenize(prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def _start(stream_id: int, request, timeout_ms: int = 60_000, confirm: bool = False) -> worker_pb2.RelayActions:
    start = worker_pb2.RelayStart(request=request, timeout_ms=timeout_ms, confirm_accepted=confirm)
    return worker_pb2.RelayActions(actions=[worker_pb2.RelayAction(stream_id=stream_id, start=start)])


def _cancel(stream_id: int) -> worker_pb2.RelayActions:
    return worker_pb2.RelayActions(
        actions=[worker_pb2.RelayAction(stream_id=stream_id, cancel=worker_pb2.RelayCancel())]
    )


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in the metrics")


async def _generate_ids(worker_stub, request) -> list[int]:
    ids: list[int] = []
    async for event in worker_stub.Generate(request, timeout=60):
        if event.HasField("tokens"):
            ids.extend(event.tokens.token_ids)
    return ids


class Streams:
    """What a Relay call delivered, by stream id, in arrival order."""

    def __init__(self) -> None:
        self.kinds: dict[int, list[str]] = {}
        self.ids: dict[int, list[int]] = {}
        self.indices: dict[int, list[int]] = {}
        self.errors: dict[int, worker_pb2.RelayError] = {}
        self.messages = 0
        self._shared = 0

    def add(self, message: worker_pb2.RelayEvents) -> None:
        self.messages += 1
        if len({e.stream_id for e in message.events if e.WhichOneof("event") == "tokens"}) > 1:
            self._shared += 1
        for event in message.events:
            kind = event.WhichOneof("event")
            self.kinds.setdefault(event.stream_id, []).append(kind)
            if kind == "tokens":
                self.ids.setdefault(event.stream_id, []).extend(event.tokens.token_ids)
                self.indices.setdefault(event.stream_id, []).append(event.tokens.first_index)
            elif kind == "error":
                self.errors[event.stream_id] = event.error

    def shared_token_messages(self) -> int:
        return self._shared

    def ended(self, stream_id: int) -> bool:
        return bool(set(self.kinds.get(stream_id, ())) & {"finished", "error"})


async def _read_until(call, streams: Streams, done) -> None:
    async with asyncio.timeout(60):
        while not done():
            message = await call.read()
            assert message is not grpc.aio.EOF, "the relay ended early"
            streams.add(message)


async def _relay_two(worker_stub, first, second, together: bool = False) -> Streams:
    """Starts `first` and `second` on one Relay stream and reads it until both have ended;
    `together`: both starts in one message (as a router's pump sends what it dispatched at
    once), so the worker starts them in one turn of its loop and the engine takes both in one
    batch."""
    call = worker_stub.Relay()
    if together:
        both = _start(1, first)
        both.actions.extend(_start(2, second).actions)
        await call.write(both)
    else:
        await call.write(_start(1, first))
        await call.write(_start(2, second))
    streams = Streams()
    await _read_until(call, streams, lambda: streams.ended(1) and streams.ended(2))
    call.cancel()
    return streams


async def test_two_requests_on_one_stream_each_equal_their_generate_call(worker_stub, worker_app):
    first, second = _request(worker_app, 24), _request(worker_app, 16, "Please summarise the refund policy.")
    streams = await _relay_two(worker_stub, first, second)
    assert streams.ids[1] == await _generate_ids(worker_stub, first)
    assert streams.ids[2] == await _generate_ids(worker_stub, second)
    for stream_id in (1, 2):
        kinds = streams.kinds[stream_id]
        # Accepted before any token (poison containment), finished last, nothing after it.
        assert kinds[0] == "accepted" and kinds[-1] == "finished" and kinds.count("finished") == 1
        assert not streams.errors
        # Each message continues where the one before ended.
        positions = streams.indices[stream_id]
        assert positions[0] == 0 and positions == sorted(set(positions))


async def test_held_tokens_of_several_requests_leave_in_one_message(worker_stub, worker_app):
    first, second = _request(worker_app, 60), _request(worker_app, 60, "Please summarise the refund policy.")
    first.flush_interval_ms = second.flush_interval_ms = 200
    # Started in one message: their tokens come in the same engine steps, so their holds fall
    # due together. (Started a message apart, a loaded machine can put the second request's
    # first step more than a quarter interval after the first's, and held tokens that are not
    # ripe leave with their own timer: a message each, which is the pacing working as meant.)
    streams = await _relay_two(worker_stub, first, second, together=True)
    # Each answer is whole and in order, as Generate gives it...
    assert streams.ids[1] == await _generate_ids(worker_stub, first)
    assert streams.ids[2] == await _generate_ids(worker_stub, second)
    # ...and the tokens the two held back went out together rather than a message each.
    assert streams.shared_token_messages() >= 1


async def test_a_cancel_stops_its_request_on_the_worker_and_not_the_others(worker_stub, worker_app):
    served_before = worker_app.state.served
    call = worker_stub.Relay()
    await call.write(_start(1, _request(worker_app, 400)))
    await call.write(_start(2, _request(worker_app, 40)))
    streams = Streams()
    # Aimed by the stream's own progress: cancelled once its first tokens came.
    await _read_until(call, streams, lambda: bool(streams.ids.get(1)))
    await call.write(_cancel(1))
    await _read_until(call, streams, lambda: streams.ended(2))
    assert "finished" in streams.kinds[2]
    assert worker_app.state.served == served_before + 2
    # The cancelled request leaves the worker: its slot is free, with no end event sent for it.
    async with asyncio.timeout(10):
        while worker_app.state.in_flight:
            await asyncio.sleep(0.02)
    assert not streams.ended(1)
    assert len(streams.ids[1]) < 400
    call.cancel()


async def test_a_start_that_asks_for_it_waits_for_the_confirm_before_the_engine_sees_it(worker_stub, worker_app):
    """Poison containment: the engine sees the request only once the router confirmed it read
    the accepted event, so a worker that dies on the request cannot leave that unknown."""
    waiting, other = _request(worker_app, 12), _request(worker_app, 24, "Please summarise the refund policy.")
    call = worker_stub.Relay()
    await call.write(_start(1, waiting, confirm=True))
    streams = Streams()
    await _read_until(call, streams, lambda: "accepted" in streams.kinds.get(1, ()))
    # A whole other request runs and ends on the stream meanwhile: not one token for the first.
    await call.write(_start(2, other))
    await _read_until(call, streams, lambda: streams.ended(2))
    assert streams.kinds[1] == ["accepted"] and "finished" in streams.kinds[2]
    # Confirms for a stream that has ended and for one never started change nothing.
    confirms = [worker_pb2.RelayAction(stream_id=i, confirm=worker_pb2.RelayConfirm()) for i in (2, 9, 1)]
    await call.write(worker_pb2.RelayActions(actions=confirms))
    await _read_until(call, streams, lambda: streams.ended(1))
    call.cancel()
    assert streams.ids[1] == await _generate_ids(worker_stub, waiting)
    assert "error" not in streams.kinds[1] + streams.kinds[2] and 9 not in streams.kinds


async def test_a_stream_whose_request_waits_hears_that_the_engine_moved(worker_stub, worker_app):
    """One router's request waits (here for its confirm) while another router's requests keep
    the engine stepping: the waiting router gets no token, so its stream carries the engine's
    step count instead, which grows."""
    waiting = worker_stub.Relay()
    await waiting.write(_start(1, _request(worker_app, 8), confirm=True))
    other = worker_stub.Relay()
    other_messages: list[worker_pb2.RelayEvents] = []

    async def keep_the_engine_busy() -> None:
        for stream_id in range(1, 1000):
            await other.write(_start(stream_id, _request(worker_app, 64)))
            while True:
                message = await other.read()
                assert message is not grpc.aio.EOF
                other_messages.append(message)
                if any(e.stream_id == stream_id and e.WhichOneof("event") == "finished" for e in message.events):
                    break

    busy = asyncio.create_task(keep_the_engine_busy())
    reports: list[int] = []
    try:
        async with asyncio.timeout(60):
            while len(reports) < 2:
                message = await waiting.read()
                assert message is not grpc.aio.EOF
                assert all(e.WhichOneof("event") == "accepted" for e in message.events)
                if message.HasField("engine"):
                    reports.append(message.engine.steps)
    finally:
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        waiting.cancel()
        other.cancel()
    assert 0 < reports[0] < reports[1]
    assert any(e.HasField("tokens") for m in other_messages for e in m.events)


async def test_a_bad_start_fails_that_request_alone_with_its_status(worker_stub, worker_app):
    call = worker_stub.Relay()
    bad = worker_pb2.WorkerGenerateRequest(request_id="bad", sampling=common_pb2.SamplingParams(max_tokens=4))
    await call.write(_start(7, bad))
    await call.write(_start(8, _request(worker_app, 8)))
    # The same id again while request 8 may still run: refused, and request 8 goes on.
    await call.write(_start(8, _request(worker_app, 8)))
    streams = Streams()
    await _read_until(call, streams, lambda: streams.ended(7) and "finished" in streams.kinds.get(8, ()))
    call.cancel()
    error = streams.errors[7]
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error.reason == Fault.INVALID_ARGUMENT.value
    assert "accepted" not in streams.kinds[7]
    assert streams.kinds[8].count("finished") == 1


async def test_a_request_past_its_timeout_ends_with_deadline_exceeded(worker_stub, worker_app):
    call = worker_stub.Relay()
    await call.write(_start(3, _request(worker_app, 1500), timeout_ms=1))
    streams = Streams()
    await _read_until(call, streams, lambda: streams.ended(3))
    call.cancel()
    assert streams.errors[3].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    async with asyncio.timeout(10):
        while worker_app.state.in_flight:
            await asyncio.sleep(0.02)


async def test_a_frame_that_does_not_parse_ends_the_relay_as_invalid_argument(worker_app, worker_stub, caplog):
    channel = grpc.aio.insecure_channel(worker_app.address)
    relay = channel.stream_stream("/ballast.v1.Worker/Relay")  # raw bytes either way
    call = relay()
    await call.write(b"\xff\xff\xff garbage")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async with asyncio.timeout(10):
            await call.read()
    await channel.close()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert classify(refused.value).fault is Fault.INVALID_ARGUMENT
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    # The worker is unharmed.
    assert await _generate_ids(worker_stub, _request(worker_app, 4))


async def test_frames_written_after_one_that_does_not_parse_do_not_turn_the_refusal_into_internal(
    worker_app, worker_stub
):
    # The shape the fuzzer found: a malformed frame, then a start and a cancel the client is
    # still writing when the worker refuses the stream.
    start = worker_pb2.RelayActions(
        actions=[
            worker_pb2.RelayAction(stream_id=1, start=worker_pb2.RelayStart(request=_request(worker_app, 4))),
            worker_pb2.RelayAction(stream_id=1, cancel=worker_pb2.RelayCancel()),
        ]
    ).SerializeToString()
    channel = grpc.aio.insecure_channel(worker_app.address)
    relay = channel.stream_stream("/ballast.v1.Worker/Relay")  # raw bytes either way
    codes = []
    for _ in range(10):
        call = relay(iter([b"\x0a\x2d\x08\x41 not a message", start, start]), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _event in call:
                pass
        codes.append(refused.value.code())
    await channel.close()
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 10
    assert await _generate_ids(worker_stub, _request(worker_app, 4))


async def test_the_router_carries_concurrent_requests_over_one_relay(router_app, router_stub, worker_app):
    requests = [chat_request(f"{PROMPT} ({n})", max_tokens=20, raw_prompt=True) for n in range(4)]
    alone = [await collect(router_stub, request, API_KEY) for request in requests]
    together = await asyncio.gather(*(collect(router_stub, request, API_KEY) for request in requests))
    for single, shared in zip(alone, together):
        assert_served(shared)
        assert shared.token_ids == single.token_ids
        assert shared.indices == list(range(len(shared.token_ids)))
    assert router_app.clients.relay_addresses() == [worker_app.address]
    # Both ends count the stream's messages and the events in them (what tokens per message is read from).
    router_metrics = router_app.telemetry.render()
    assert _metric(router_metrics, 'ballast_router_relay_messages_total{direction="from_workers"}') > 0
    assert _metric(router_metrics, "ballast_router_relay_events_total") >= _metric(
        router_metrics, 'ballast_router_relay_messages_total{direction="from_workers"}'
    )
    worker_metrics = worker_app.telemetry.render()
    assert (
        0
        < _metric(worker_metrics, "ballast_worker_relay_messages_total")
        <= _metric(worker_metrics, "ballast_worker_relay_events_total")
    )


async def test_a_worker_without_relay_gets_a_generate_call_per_request(etcd_server, tiny_model_dir):
    prefix = f"/ballast-test-{uuid.uuid4().hex[:8]}/"
    config = make_config(etcd_server, tiny_model_dir, prefix, BALLAST__WORKER__RELAY="false")
    worker = await create_worker(config)
    await worker.registration.registered.wait()
    router = await create_router(make_config(etcd_server, tiny_model_dir, prefix))
    try:
        assert await router.membership.wait_for(lambda workers: worker.worker_id in workers, timeout=10)
        assert router.membership.get(worker.worker_id).relay is False
        channel = grpc.aio.insecure_channel(router.address)
        result = await collect(
            inference_pb2_grpc.InferenceStub(channel), chat_request(PROMPT, max_tokens=12, raw_prompt=True), API_KEY
        )
        await channel.close()
        assert_served(result)
        assert router.clients.relay_addresses() == []
    finally:
        await router.shutdown(grace_s=1.0)
        await worker.shutdown(grace_s=1.0)
