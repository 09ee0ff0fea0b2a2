"""Better answers delivered through the router across the whole local mesh (every service a
process; real etcd, Redis and Kafka broker): degraded requests survive a broker outage in the
router's outbox, a backfill killed mid-batch loses and repeats nothing, tenants never see each
other's answers, and a malformed record is dead-lettered without stopping the consumer."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import grpc
import pytest

from ballast.v1 import backfill_pb2, common_pb2
from services.cli.client import chat_request, collect
from services.cli.mesh import BACKFILL_API_KEY, LOCAL_API_KEY, Mesh, MeshSpec
from services.common.degraded.codec import degraded_request_pb, kafka_key, make_ticket
from services.common.degraded.codec import Level
from services.common.degraded.topics import DEADLETTER_TOPIC, DLQ_ERROR_HEADER
from services.common.generation import Sampling
from services.router.degrade.handoff import HandOff
from services.router.requests import InferenceRequest
from tests.component.test_backfill_handoff import read_topic
from tests.integration.test_mesh import metric_value, registered_ids, scrape

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

OTHER_KEY = "other-tenant-key"
PROMPT = "Where is my order? I paid for a blue phone case yesterday."
STORED = "ballast_backfill_processed_total"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    overrides = {
        "degrade": {"delivery_timeout_s": 5},
        # Quick group joins, and a short wait for a pool that comes back, so tests stay short.
        "backfill": {
            "session_timeout_ms": 6000,
            "heartbeat_interval_ms": 1000,
            "busy_backoff_s": 0.5,
            "busy_backoff_max_s": 2,
            "retry_backoff_s": 0.5,
            "replay_concurrency": 4,
            "subscribe_poll_s": 0.5,
            "delivery_timeout_s": 5,
        },
    }
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("delivery"),
        model_dir=tiny_model_dir,
        workers=1,
        worker_capacity=8,
        api_keys={LOCAL_API_KEY: "local", OTHER_KEY: "globex", BACKFILL_API_KEY: "ballast-backfill"},
        overrides=overrides,
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


def backfill_service(mesh):
    return next(s for s in mesh.services if s.name == "backfill")


async def stored_count(mesh) -> float:
    return metric_value(await scrape(backfill_service(mesh).metrics_port), STORED, outcome="stored")


async def hand_off(handoff: HandOff, session: str, text: str = PROMPT, max_tokens: int = 16) -> str:
    request = InferenceRequest(
        request_id=uuid.uuid4().hex,
        session_id=session,
        tenant="local",
        model="tiny",
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
        tier="A",
        prompt=text,
    )
    ticket = make_ticket("local", request.request_id)
    record = degraded_request_pb(
        request,
        ticket=ticket,
        tier="A",
        level=Level.RULES,
        reason="admission",
        degraded_text="quick answer",
        degraded_by="rules",
        received_at=time.time(),
    )
    await handoff.submit(kafka_key(session, ticket), record.SerializeToString())
    return ticket


async def pushes(
    router, sessions: list[str], expected: int, timeout_s: float = 120.0, settle_s: float = 2.0
) -> list[str]:
    """Tickets pushed to one router subscription per session until `expected` arrived, plus
    any that come within `settle_s` after (a duplicate would). Resubscribes when the
    backfill is briefly away, as a client would."""
    got: list[str] = []
    enough = asyncio.Event()

    async def follow(session: str) -> None:
        while True:
            call = router.Subscribe(
                backfill_pb2.SubscribeRequest(session_id=session),
                metadata=(("x-api-key", LOCAL_API_KEY),),
                timeout=timeout_s,
            )
            try:
                async for answer in call:
                    got.append(answer.ticket)
                    if len(got) >= expected:
                        enough.set()
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.5)
            finally:
                call.cancel()

    followers = [asyncio.create_task(follow(s)) for s in sessions]
    try:
        waiting = asyncio.create_task(enough.wait())
        done, _ = await asyncio.wait([waiting, *followers], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        for task in done:
            if task is not waiting:
                task.result()  # a follower failed: raise its error
        assert enough.is_set(), f"only {len(got)} of {expected} answers pushed within {timeout_s:.0f}s"
        await asyncio.sleep(settle_s)
    finally:
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
    return got


async def get_backfill(router, ticket: str, key: str = LOCAL_API_KEY) -> backfill_pb2.BackfilledAnswer:
    return await router.GetBackfill(
        backfill_pb2.GetAnswerRequest(ticket=ticket), metadata=(("x-api-key", key),), timeout=10
    )


async def wait_stored(router, ticket: str, timeout_s: float = 90.0) -> backfill_pb2.BackfilledAnswer:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await get_backfill(router, ticket)
        except grpc.aio.AioRpcError as error:
            assert error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE), error
            assert time.monotonic() < deadline, f"ticket {ticket} not answered within {timeout_s:.0f}s"
            await asyncio.sleep(0.3)


async def stop_primary(mesh):
    worker = mesh.workers()[0]
    os.kill(worker.pid, signal.SIGTERM)
    await asyncio.to_thread(worker.process.wait, 30)
    deadline = time.monotonic() + 15
    while worker.name in await registered_ids(mesh):
        assert time.monotonic() < deadline, "the stopped worker kept its lease"
        await asyncio.sleep(0.2)
    return worker


async def test_a_backfill_killed_mid_batch_loses_and_repeats_nothing(mesh, router, handoff):
    stored_before = await stored_count(mesh)
    sessions = [f"kill-{i}-{uuid.uuid4().hex[:6]}" for i in range(8)]
    # Answers long enough that the batch lasts seconds here, and still lasts on a faster machine.
    tickets = [await hand_off(handoff, sessions[i % 8], f"{PROMPT} #{i}", max_tokens=128) for i in range(40)]
    service = backfill_service(mesh)
    deadline = time.monotonic() + 90
    while (done := await stored_count(mesh) - stored_before) < 3:
        assert time.monotonic() < deadline, "the backfill did not start on the batch"
        await asyncio.sleep(0.02)
    os.kill(service.pid, signal.SIGKILL)
    await asyncio.to_thread(service.process.wait, 10)
    assert done < len(tickets), "the batch was over before the kill"

    await asyncio.to_thread(mesh.restart_service, service)
    pushed = await pushes(router, sessions, len(tickets))
    assert sorted(pushed) == sorted(tickets), "each ticket pushed exactly once"
    for ticket in tickets:
        assert (await get_backfill(router, ticket)).ticket == ticket


async def test_another_tenant_cannot_read_a_ticket(mesh, router, handoff):
    session = f"private-{uuid.uuid4().hex[:6]}"
    ticket = await hand_off(handoff, session)
    answer = await wait_stored(router, ticket)
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await get_backfill(router, ticket, OTHER_KEY)
    assert denied.value.code() == grpc.StatusCode.NOT_FOUND
    for target in ({"ticket": ticket}, {"session_id": session}):
        call = router.Subscribe(
            backfill_pb2.SubscribeRequest(**target), metadata=(("x-api-key", OTHER_KEY),), timeout=3
        )
        with pytest.raises(grpc.aio.AioRpcError) as waited:
            async for leaked in call:
                raise AssertionError(f"another tenant got ticket {leaked.ticket}")
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Its owner still gets it pushed.
    assert await pushes(router, [session], 1, settle_s=0) == [answer.ticket]


async def test_a_malformed_record_is_dead_lettered_and_the_consumer_goes_on(mesh, router, handoff):
    garbage_key = f"garbage-{uuid.uuid4().hex[:6]}".encode()
    await handoff.submit(garbage_key, b"\xff\x00 not a degraded request")
    session = f"after-garbage-{uuid.uuid4().hex[:6]}"
    ticket = await hand_off(handoff, session)
    assert await pushes(router, [session], 1, settle_s=0) == [ticket]
    records = await asyncio.to_thread(read_topic, mesh.kafka.bootstrap, DEADLETTER_TOPIC, 1, 60.0)
    dead = [r for r in records if r.key() == garbage_key]
    assert len(dead) == 1 and dead[0].value() == b"\xff\x00 not a degraded request"
    assert b"invalid" in dict(dead[0].headers())[DLQ_ERROR_HEADER]


# Last: the fresh Tansu broker it leaves behind fails some records of producers started after
# it ("AlreadyExists" in its memory storage), which would only slow the tests that follow.
async def test_requests_degraded_while_the_broker_is_down_are_each_answered_once(mesh, router):
    stored_before = await stored_count(mesh)
    worker = await stop_primary(mesh)
    await asyncio.to_thread(mesh.kafka.stop)
    sessions = [f"outage-{i}-{uuid.uuid4().hex[:6]}" for i in range(10)]
    try:

        async def degrade(i: int) -> str:
            request = chat_request(f"{PROMPT} #{i}", max_tokens=16, raw_prompt=True, session_id=sessions[i % 10])
            result = await collect(router, request, LOCAL_API_KEY)
            assert result.finished.degradation == common_pb2.DEGRADATION_RULES
            assert result.finished.backfill_ticket, "a degraded answer without a ticket"
            return result.finished.backfill_ticket

        tickets: list[str] = []
        for first in range(0, 100, 20):  # 20 at once: quick, and the router stays responsive
            tickets += await asyncio.gather(*(degrade(i) for i in range(first, first + 20)))
    finally:
        # A fresh broker (memory storage: it knows nothing) and the primary pool come back.
        await asyncio.to_thread(mesh.kafka.restart)
        mesh.save_state()
        await asyncio.to_thread(mesh.restart_service, worker)
    assert len(set(tickets)) == 100

    pushed = await pushes(router, sessions, 100, timeout_s=180)
    assert sorted(pushed) == sorted(tickets), "each ticket pushed exactly once"
    assert await stored_count(mesh) - stored_before == 100, "each ticket stored exactly once"
    answer = await get_backfill(router, tickets[0])
    assert answer.degraded_level == common_pb2.DEGRADATION_RULES and answer.text and answer.model == "tiny"
