"""The backfill's answers keep no Redis TTL and are removed by its own sweep after
`answer_retention_s`; GetAnswer tells an answer not ready yet from one that expired and from
one the store lost, per tenant, on one Redis server and on a Redis Cluster."""

from __future__ import annotations

import time
import uuid

import pytest
import pytest_asyncio

from ballast.v1 import backfill_pb2
from services.backfill.store import AnswerState, AnswerStore, ClusterAnswerStore
from services.common.config import RedisConfig
from services.common.degraded.codec import make_ticket, timestamp
from services.common.redis_client import make_client

pytestmark = pytest.mark.asyncio(loop_scope="session")

TENANT = "acme"
RETENTION_S = 600


@pytest.fixture(params=["server", "cluster"])
def backend(request) -> RedisConfig:
    if request.param == "cluster":
        return RedisConfig(url=request.getfixturevalue("redis_cluster").url, cluster=True)
    return RedisConfig(url=request.getfixturevalue("redis_server").url)


@pytest_asyncio.fixture(loop_scope="session")
async def store(backend):
    store_type = ClusterAnswerStore if backend.cluster else AnswerStore
    store = store_type(make_client(backend), prefix=f"test-{uuid.uuid4().hex[:8]}:backfill:", retention_s=RETENTION_S)
    yield store
    await store.redis.aclose()


def answer(session: str, n: int) -> backfill_pb2.BackfilledAnswer:
    return backfill_pb2.BackfilledAnswer(
        ticket=make_ticket(TENANT, f"{session}-{n}"),
        tenant=TENANT,
        session_id=session,
        text=f"answer {n}",
        received_at=timestamp(1_800_000_000 + n),
    )


async def test_every_key_of_an_answer_lives_without_a_ttl(store):
    a = answer(uuid.uuid4().hex, 1)
    assert await store.put_once(a)
    assert await store.claim(a.ticket, "sub")
    assert await store.confirm(a.ticket, "sub")
    await store.add_attempt(a.ticket)
    for key in (
        store._answer(a.ticket),
        store._delivered(a.ticket),
        store._attempts(a.ticket),
        store._state(a.ticket),
        store._session(TENANT, a.session_id),
        store.retained_key,
    ):
        assert await store.redis.ttl(key) == -1, key


async def test_the_sweep_removes_what_is_past_retention_and_leaves_it_expired(store):
    session = uuid.uuid4().hex
    old, fresh = answer(session, 1), answer(session, 2)
    await store.put_once(old)
    assert await store.state(old.ticket, TENANT) is AnswerState.PENDING  # it is there: no state asked
    now = time.time()
    # The old one was stored long ago: move its retention clock back.
    await store.redis.zadd(store.retained_key, {old.ticket: (now - RETENTION_S - 5) * 1000})
    await store.put_once(fresh)
    assert await store.claim(old.ticket, "sub")
    assert await store.sweep(now_s=now) == 1
    assert await store.get(old.ticket) is None
    assert await store.redis.exists(store._delivered(old.ticket)) == 0
    assert await store.state(old.ticket, TENANT) is AnswerState.EXPIRED
    assert await store.state(old.ticket, "globex") is AnswerState.PENDING  # another tenant learns nothing
    assert (await store.get(fresh.ticket)).text == "answer 2"
    assert [a.ticket for a in await store.claim_session(TENANT, session, "sub2", limit=10)] == [fresh.ticket]
    # The expired mark is kept for another retention, then swept in turn.
    assert await store.sweep(now_s=now + RETENTION_S + 10) == 1  # the fresh one's turn
    assert await store.sweep(now_s=now + 2 * RETENTION_S + 20) == 0
    assert await store.state(old.ticket, TENANT) is AnswerState.PENDING
    assert await store.redis.zcard(store.retained_key) == 0


async def test_an_answer_gone_while_it_should_be_kept_is_lost_and_one_never_stored_is_pending(store):
    a = answer(uuid.uuid4().hex, 1)
    await store.put_once(a)
    await store.redis.delete(store._answer(a.ticket))  # what a store that lost data looks like
    assert await store.state(a.ticket, TENANT) is AnswerState.LOST
    assert await store.state(make_ticket(TENANT, "never"), TENANT) is AnswerState.PENDING


async def test_attempts_of_a_request_never_answered_are_swept_too(store):
    ticket = make_ticket(TENANT, uuid.uuid4().hex)
    assert await store.add_attempt(ticket) == 1
    assert await store.sweep(now_s=time.time() + RETENTION_S + 5) == 1
    assert await store.attempts(ticket) == 0
    assert await store.state(ticket, TENANT) is AnswerState.PENDING
