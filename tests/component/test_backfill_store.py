"""The backfill's answer store on a real Redis: a session's ready answers claimed in one call,
exactly once across subscribers; marks given back only by their holder; and notices that
reach every subscription again after the listener lost its connection."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import pytest_asyncio

from ballast.v1 import backfill_pb2
from services.backfill.store import AnswerStore, ClusterAnswerStore, Notices
from services.common.config import RedisConfig
from services.common.redis_client import is_cluster, make_client, open_pubsub
from redis.asyncio.cluster import RedisCluster
from services.common.degraded.codec import make_ticket, timestamp

pytestmark = pytest.mark.asyncio(loop_scope="session")

TENANT = "acme"


@pytest.fixture(params=["server", "cluster"])
def backend(request) -> RedisConfig:
    """One Redis server, and a Redis Cluster (where the keys of one session's answers live on
    different masters)."""
    if request.param == "cluster":
        return RedisConfig(url=request.getfixturevalue("redis_cluster").url, cluster=True)
    return RedisConfig(url=request.getfixturevalue("redis_server").url)


def new_store(backend: RedisConfig, **options) -> AnswerStore:
    store_type = ClusterAnswerStore if backend.cluster else AnswerStore
    return store_type(make_client(backend), prefix=f"test-{uuid.uuid4().hex[:8]}:backfill:", retention_s=600, **options)


@pytest_asyncio.fixture(loop_scope="session")
async def store(backend):
    store = new_store(backend)
    yield store
    await store.redis.aclose()


async def kill_pubsub_connections(client) -> int:
    """Cuts every pub/sub connection off, as a Redis restart or a network blip would."""
    if is_cluster(client):
        killed = await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub", target_nodes=RedisCluster.ALL_NODES)
        return sum(killed.values()) if isinstance(killed, dict) else int(killed)
    return await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")


def answer(session: str, n: int, tenant: str = TENANT) -> backfill_pb2.BackfilledAnswer:
    return backfill_pb2.BackfilledAnswer(
        ticket=make_ticket(tenant, f"{session}-{n}"),
        tenant=tenant,
        session_id=session,
        text=f"answer {n}",
        received_at=timestamp(1_800_000_000 + n),
    )


async def test_a_session_claim_takes_each_ready_answer_once_oldest_first(store):
    session = uuid.uuid4().hex
    stored = [answer(session, n) for n in (3, 1, 2)]
    for a in stored:
        assert await store.put_once(a)

    first = await store.claim_session(TENANT, session, "sub-a", limit=2)
    assert [a.text for a in first] == ["answer 1", "answer 2"]  # by original timestamp, at most 2
    rest = await store.claim_session(TENANT, session, "sub-b", limit=10)
    assert [a.text for a in rest] == ["answer 3"]
    # The same lease takes its answers again (a claim whose reply was lost must not lose them)...
    assert [a.text for a in await store.claim_session(TENANT, session, "sub-a", limit=10)] == ["answer 1", "answer 2"]
    # ...until their pushes are confirmed: then no one takes them again.
    for pushed in first:
        assert await store.confirm(pushed.ticket, "sub-a")
        assert await store.confirm(pushed.ticket, "sub-a")  # confirming twice changes nothing
    assert await store.claim_session(TENANT, session, "sub-a", limit=10) == []
    # The marks are the ticket marks: a ticket subscription cannot push them again, whether
    # their push was confirmed or is still under another's lease.
    assert not await store.claim(first[0].ticket, "sub-c")
    assert not await store.claim(stored[0].ticket, "sub-c")
    assert not await store.confirm(stored[0].ticket, "sub-c")
    assert await store.claim(stored[0].ticket, "sub-b")


async def test_a_lease_whose_subscription_died_expires_and_the_answer_goes_to_the_next(backend):
    store = new_store(backend, claim_lease_s=1)
    try:
        session = uuid.uuid4().hex
        a = answer(session, 1)
        await store.put_once(a)
        assert [x.ticket for x in await store.claim_session(TENANT, session, "died", limit=10)] == [a.ticket]
        assert await store.claim_session(TENANT, session, "next", limit=10) == []
        await asyncio.sleep(1.5)  # the lease's end, in Redis's own time: not a timing assumption
        assert [x.ticket for x in await store.claim_session(TENANT, session, "next", limit=10)] == [a.ticket]
        # The one that died cannot confirm a push it no longer holds.
        assert not await store.confirm(a.ticket, "died")
        assert await store.confirm(a.ticket, "next")
    finally:
        await store.redis.aclose()


async def test_a_session_claim_sees_only_its_tenants_index(store):
    session = uuid.uuid4().hex
    await store.put_once(answer(session, 1, tenant="globex"))
    assert await store.claim_session(TENANT, session, "sub-a", limit=10) == []
    assert [a.tenant for a in await store.claim_session("globex", session, "sub-a", limit=10)] == ["globex"]


async def test_only_the_holder_gives_a_mark_back_and_the_answer_is_announced_again(store):
    session = uuid.uuid4().hex
    a = answer(session, 1)
    await store.put_once(a)
    [claimed] = await store.claim_session(TENANT, session, "holder", limit=10)

    notices = await open_pubsub(store.redis, ignore_subscribe_messages=True)
    await notices.subscribe(store.channel)
    try:
        await store.unclaim(claimed, "someone-else")
        assert await store.claim_session(TENANT, session, "sub-b", limit=10) == []  # still held
        await store.unclaim(claimed, "holder")
        assert await next_message(notices) == f"{TENANT}\0{session}\0{a.ticket}"
    finally:
        await notices.aclose()
    assert [x.ticket for x in await store.claim_session(TENANT, session, "sub-b", limit=10)] == [a.ticket]


async def next_message(pubsub, timeout_s: float = 5.0) -> str | None:
    """The next published message (the subscribe confirmation is skipped, and reads as None)."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + timeout_s
    while loop.time() < ends:
        message = await pubsub.get_message(timeout=max(0.0, ends - loop.time()))
        if message is not None:
            return message["data"].decode()
    return None


async def test_every_subscription_is_woken_when_the_notice_listener_reconnects(store, backend):
    """A notice published while the listener is disconnected is lost; the reconnect makes up for it."""
    listener = make_client(backend)
    notices = Notices(listener, store.channel)
    session_event = notices.watch([("session", TENANT, "s1")])
    ticket_event = notices.watch([("ticket", "t-1")])
    await notices.start()
    try:
        both = lambda: asyncio.wait_for(asyncio.gather(session_event.wait(), ticket_event.wait()), 10)  # noqa: E731
        await both()  # connected: whatever was announced before is read again
        session_event.clear()
        ticket_event.clear()
        assert await kill_pubsub_connections(store.redis) >= 1
        await both()
    finally:
        await notices.stop()
        await listener.aclose()


class CallContext:
    """The part of a gRPC servicer context Subscribe reads: the caller's metadata."""

    def invocation_metadata(self):
        return (("x-api-key", "acme-key"),)


def subscription_servicer(store: AnswerStore, backend: RedisConfig):
    from services.backfill.servicer import BackfillServicer
    from services.backfill.settings import BackfillSettings
    from services.common.config import AuthConfig
    from services.common.auth import Authenticator

    notices = Notices(make_client(backend), store.channel)
    auth = Authenticator(AuthConfig(enabled=True, api_keys={"acme-key": TENANT}))
    return BackfillServicer(BackfillSettings(subscribe_poll_s=0.2), auth, store, notices)


async def pushed(servicer, session: str, count: int) -> list[str]:
    stream = servicer.Subscribe(backfill_pb2.SubscribeRequest(session_id=session), CallContext())
    got = [(await asyncio.wait_for(anext(stream), 5)).text for _ in range(count)]
    # Asking for one more confirms the last push; the stream then waits for news until closed.
    waiting = asyncio.create_task(anext(stream))
    await asyncio.sleep(0.1)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await stream.aclose()
    return got


@pytest.mark.parametrize("written", [0, 1])
async def test_a_push_that_was_not_written_gives_back_it_and_the_rest_of_its_batch(store, backend, written):
    """The stream stops at the push after `written` written ones (the client left): the unwritten
    answers of the claimed batch go to the next subscription, the written ones never again."""
    session = uuid.uuid4().hex
    answers = [answer(session, n) for n in (1, 2, 3)]
    for a in answers:
        await store.put_once(a)
    servicer = subscription_servicer(store, backend)
    try:
        stream = servicer.Subscribe(backfill_pb2.SubscribeRequest(session_id=session), CallContext())
        for _ in range(written + 1):
            await anext(stream)  # asking for the next one means the previous was written
        await stream.aclose()  # the push in hand was not written
        expected = [f"answer {n}" for n in (1, 2, 3)][written:]
        assert await pushed(servicer, session, len(expected)) == expected
        assert await store.claim_session(TENANT, session, "late", limit=10) == []
        # Every written push was confirmed: its mark is kept for good, no lease left to expire.
        for a in answers:
            assert (await store.redis.get(store._delivered(a.ticket))).startswith(b"sent:")
    finally:
        await servicer.notices.redis.aclose()


async def test_an_unreadable_answer_is_skipped_and_the_rest_are_pushed(store):
    """Bytes that are no BackfilledAnswer (not written by the service) never block a session."""
    session = uuid.uuid4().hex
    good = answer(session, 2)
    await store.put_once(good)
    bad_ticket = make_ticket(TENANT, f"{session}-bad")
    await store.redis.set(store._answer(bad_ticket), b"\xff\xff not a protobuf")
    await store.redis.zadd(store._session(TENANT, session), {bad_ticket: 1})

    assert [a.ticket for a in await store.claim_session(TENANT, session, "sub-a", limit=10)] == [good.ticket]
    assert await store.claim_session(TENANT, session, "sub-b", limit=10) == []
    # The unreadable one is marked for good, not leased: no later read trips on it again.
    assert (await store.redis.get(store._delivered(bad_ticket))).startswith(b"sent:")


async def test_put_once_keeps_the_first_answer_and_announces_every_time(store):
    session = uuid.uuid4().hex
    first, second = answer(session, 1), answer(session, 1)
    second.text = "a different replay"
    notices = await open_pubsub(store.redis, ignore_subscribe_messages=True)
    await notices.subscribe(store.channel)
    try:
        assert await store.put_once(first)
        assert not await store.put_once(second)  # a redelivered record never replaces it
        notice = f"{TENANT}\0{session}\0{first.ticket}"
        assert [await next_message(notices), await next_message(notices)] == [notice, notice]
    finally:
        await notices.aclose()
    assert (await store.get(first.ticket)).text == "answer 1"
    # No Redis TTL: under volatile-lru, cache pressure can evict only keys that carry one.
    assert await store.redis.ttl(store._answer(first.ticket)) == -1


async def test_the_session_index_keeps_the_newest_and_answers_without_a_session_are_stored(backend):
    small = new_store(backend, index_max=2)
    try:
        session = uuid.uuid4().hex
        for n in (1, 2, 3):
            await small.put_once(answer(session, n))
        assert [a.text for a in await small.claim_session(TENANT, session, "sub", limit=10)] == ["answer 2", "answer 3"]
        lone = answer("", 7)
        assert await small.put_once(lone)
        assert (await small.get(lone.ticket)).text == "answer 7"
    finally:
        await small.redis.aclose()


async def test_on_a_cluster_a_tickets_keys_share_one_slot_and_a_sessions_answers_spread(redis_cluster):
    store = new_store(RedisConfig(url=redis_cluster.url, cluster=True))
    try:
        await store.redis.initialize()  # the slot map
        slot = store.redis.keyslot
        tickets = [make_ticket(TENANT, f"spread-{n}") for n in range(24)]
        for ticket in tickets:
            assert slot(store._answer(ticket)) == slot(store._delivered(ticket)) == slot(store._attempts(ticket))
        # Many answers of one session are not piled on one master.
        assert len({store.redis.nodes_manager.get_node_from_slot(slot(store._answer(t))).name for t in tickets}) > 1
        with pytest.raises(ValueError):
            ClusterAnswerStore(store.redis, prefix="ballast:{backfill}:", retention_s=600)
    finally:
        await store.redis.aclose()
