"""Subscribe and GetBackfill on the router, relayed to the backfill service: a real router and
worker (tiny model), the backfill service on a real Kafka-protocol broker and Redis. Answers
pushed live and to a late subscriber, tenants kept apart, bad input refused, and a backfill
that is away answered with UNAVAILABLE while Generate goes on."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import pytest_asyncio

from ballast.v1 import backfill_pb2, inference_pb2_grpc
from services.backfill.app import create_server as create_backfill
from services.backfill.settings import BackfillSettings
from services.cli.client import chat_request, collect
from services.common.degraded.codec import make_ticket
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.processes import free_port
from services.config import load_config
from services.router.app import create_server as create_router
from tests.component.conftest import API_KEY, TENANT, make_config

# handoff: the same fixture, on this module's topic (names).
from tests.component.test_backfill_service import OTHER_KEY, PROMPT, domain_request, hand_off, handoff, meta, wait_for  # noqa: F401

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEYS = f'{{"{API_KEY}": "{TENANT}", "{OTHER_KEY}": "globex"}}'
BACKFILL_UP = 'ballast_dependency_up{dependency="backfill"} 1.0'
BACKFILL_DOWN = 'ballast_dependency_up{dependency="backfill"} 0.0'


@pytest.fixture(scope="module")
def names():
    suffix = uuid.uuid4().hex[:8]
    return {
        "topic": f"degraded-{suffix}",
        "group": f"backfill-{suffix}",
        "prefix": f"proxy-{suffix}:backfill:",
        "port": free_port(),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def router(etcd_server, tiny_model_dir, etcd_prefix, worker_app, names):
    config = make_config(
        etcd_server,
        tiny_model_dir,
        etcd_prefix,
        BALLAST__AUTH__API_KEYS=KEYS,
        BALLAST__ROUTER__BACKFILL_ADDRESS=f"127.0.0.1:{names['port']}",
        BALLAST__ROUTER__BACKFILL_TIMEOUT_S="2",
    )
    app = await create_router(config)
    assert await app.membership.wait_for(lambda workers: worker_app.worker_id in workers, timeout=10)
    yield app
    await app.shutdown(grace_s=1.0)


def backfill_settings(router, names) -> BackfillSettings:
    return BackfillSettings(
        port=names["port"],
        topic=names["topic"],
        backfilled_topic=f"{names['topic']}-done",
        deadletter_topic=f"{names['topic']}-dead",
        topic_partitions=1,
        group_id=names["group"],
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        router_address=router.address,
        router_api_key=API_KEY,
        replay_timeout_s=30,
        retry_backoff_s=0.2,
        busy_backoff_s=0.2,
        redis_prefix=names["prefix"],
        delivery_timeout_s=5,
    )


async def start_backfill(kafka_broker, redis_server, router, names):
    config = load_config(
        environ={
            "BALLAST__KAFKA__BOOTSTRAP": kafka_broker.bootstrap,
            "BALLAST__REDIS__URL": redis_server.url,
            "BALLAST__AUTH__API_KEYS": KEYS,
            "BALLAST__TELEMETRY__METRICS_PORT": "0",
        }
    )
    return await create_backfill(config, backfill_settings(router, names))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def backfill(kafka_broker, redis_server, router, names):
    # A dict, so the outage test can swap in the restarted service for the teardown.
    holder = {"app": await start_backfill(kafka_broker, redis_server, router, names)}
    yield holder
    await holder["app"].shutdown(grace_s=1.0)


@pytest_asyncio.fixture(loop_scope="session")
async def stub(router):
    async with grpc.aio.insecure_channel(router.address, options=CHANNEL_OPTIONS) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def pushed(stub, count: int, key: str = API_KEY, timeout_s: float = 60.0, **target) -> list:
    """The first `count` answers a router subscription pushes."""
    got: list = []
    call = stub.Subscribe(backfill_pb2.SubscribeRequest(**target), metadata=meta(key), timeout=timeout_s)
    try:
        async for answer in call:
            got.append(answer)
            if len(got) >= count:
                break
    finally:
        call.cancel()
    return got


async def get_backfill(stub, ticket: str, key: str = API_KEY):
    return await stub.GetBackfill(backfill_pb2.GetAnswerRequest(ticket=ticket), metadata=meta(key), timeout=5)


async def rpc_error(awaitable) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await awaitable
    return raised.value


async def test_a_router_subscription_gets_each_answer_pushed_once(backfill, handoff, stub):
    session = f"live-{uuid.uuid4().hex[:6]}"
    # Open before anything is ready: answers are pushed as the backfill stores them.
    listening = asyncio.create_task(pushed(stub, 2, session_id=session))
    requests = [domain_request(f"{PROMPT} #{i}", session) for i in range(2)]
    tickets = [await hand_off(handoff, r) for r in requests]
    answers = await asyncio.wait_for(listening, 90)
    assert [a.ticket for a in answers] == tickets
    for request, answer in zip(requests, answers):
        direct = await collect(stub, chat_request(request.prompt, max_tokens=24, raw_prompt=True), API_KEY)
        assert answer.text == direct.text and answer.tenant == TENANT and answer.session_id == session
        # GetBackfill reads the same stored answer again.
        assert await get_backfill(stub, answer.ticket) == answer
    # Pushed once: a subscription on the ticket now ends without it.
    assert await pushed(stub, 1, timeout_s=10, ticket=tickets[0]) == []


async def test_a_late_subscriber_gets_what_was_stored_while_it_was_away(backfill, handoff, stub):
    session = f"late-{uuid.uuid4().hex[:6]}"
    ticket = await hand_off(handoff, domain_request(PROMPT, session, max_tokens=8))

    async def stored():
        try:
            await get_backfill(stub, ticket)
            return True
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND
            return False

    await wait_for(stored, what="the answer to be stored")
    answers = await pushed(stub, 1, session_id=session)
    assert [a.ticket for a in answers] == [ticket]


async def test_tenants_are_kept_apart_and_bad_input_is_refused(backfill, handoff, stub):
    session = f"tenant-{uuid.uuid4().hex[:6]}"
    ticket = await hand_off(handoff, domain_request(PROMPT, session, max_tokens=8))
    await wait_for(lambda: backfill["app"].store.get(ticket), what="the answer to be stored")
    # Another tenant's ticket looks exactly like one that is not ready.
    assert (await rpc_error(get_backfill(stub, ticket, OTHER_KEY))).code() == grpc.StatusCode.NOT_FOUND
    missing = make_ticket(TENANT, uuid.uuid4().hex)
    assert (await rpc_error(get_backfill(stub, missing))).code() == grpc.StatusCode.NOT_FOUND
    # Its subscriptions see nothing of it, by ticket or by session, until their deadline.
    for target in ({"ticket": ticket}, {"session_id": session}):
        error = await rpc_error(pushed(stub, 1, OTHER_KEY, timeout_s=2, **target))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The owner still gets it pushed.
    assert [a.ticket for a in await pushed(stub, 1, ticket=ticket)] == [ticket]

    bad = await rpc_error(get_backfill(stub, "not-a-ticket"))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "ticket" in bad.details()
    for target in ({"ticket": "not-a-ticket"}, {}, {"session_id": "x" * 500}):
        error = await rpc_error(pushed(stub, 1, **target))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = await rpc_error(pushed(stub, 1, key="wrong-key", ticket=ticket))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_backfill_away_is_unavailable_and_generate_goes_on(
    backfill, handoff, router, stub, kafka_broker, redis_server, names
):
    session = f"away-{uuid.uuid4().hex[:6]}"
    ticket = await hand_off(handoff, domain_request(PROMPT, session, max_tokens=8))
    await wait_for(lambda: backfill["app"].store.get(ticket), what="the answer to be stored")
    assert BACKFILL_UP in router.telemetry.render()
    await backfill["app"].shutdown(grace_s=1.0)

    for call in (get_backfill(stub, ticket), pushed(stub, 1, session_id=session)):
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "backfill service" in error.details()

    async def reported_down():
        return BACKFILL_DOWN in router.telemetry.render()

    await wait_for(reported_down, timeout_s=30, what="the router to report the backfill down")
    # Bad input is still refused as such; Generate does not need the backfill at all.
    assert (await rpc_error(get_backfill(stub, "not-a-ticket"))).code() == grpc.StatusCode.INVALID_ARGUMENT
    answer = await collect(stub, chat_request(PROMPT, max_tokens=8, raw_prompt=True), API_KEY)
    assert answer.finished is not None and answer.token_ids

    # Back on the same address: the router finds it again, and nothing stored was lost.
    backfill["app"] = await start_backfill(kafka_broker, redis_server, router, names)

    async def reported_up():
        return BACKFILL_UP in router.telemetry.render()

    await wait_for(reported_up, timeout_s=30, what="the router to report the backfill up")
    assert [a.ticket for a in await pushed(stub, 1, session_id=session)] == [ticket]
