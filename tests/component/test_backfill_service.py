"""The backfill service in process on port 0, against a real Kafka-protocol broker, Redis, and the
real router and worker (tiny model): degraded requests handed off → replayed on the full model
→ stored once → pushed exactly once per ticket; poison records dead-lettered."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
import pytest_asyncio

from ballast.v1 import backfill_pb2, backfill_pb2_grpc, common_pb2
from services.backfill.app import create_server as create_backfill
from services.backfill.settings import BackfillSettings
from services.cli.client import chat_request, collect
from services.common.degraded.codec import degraded_request_pb, kafka_key, make_ticket
from services.common.degraded.codec import Level
from services.common.degraded.topics import DLQ_ATTEMPTS_HEADER, DLQ_ERROR_HEADER
from services.common.generation import Sampling
from services.common.grpc_server import CHANNEL_OPTIONS
from services.config import load_config
from services.router.degrade.handoff import HandOff, HandOffSettings
from services.router.requests import InferenceRequest
from tests.polling import poll
from tests.component.conftest import API_KEY, TENANT
from tests.component.test_backfill_handoff import read_topic

pytestmark = pytest.mark.asyncio(loop_scope="session")

OTHER_KEY = "other-key"
PROMPT = "Where is my order? I paid for a blue phone case yesterday."


@pytest.fixture(scope="module")
def names():
    suffix = uuid.uuid4().hex[:8]
    return {
        "topic": f"degraded-{suffix}",
        "backfilled": f"backfilled-{suffix}",
        "deadletter": f"dead-{suffix}",
        "group": f"backfill-{suffix}",
        "prefix": f"test-{suffix}:backfill:",
    }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def backfill_app(kafka_broker, redis_server, router_app, names):
    config = load_config(
        environ={
            "BALLAST__ETCD__HOST": router_app.config.etcd.host,
            "BALLAST__ETCD__PORT": str(router_app.config.etcd.port),
            "BALLAST__ETCD__PREFIX": router_app.config.etcd.prefix,
            "BALLAST__KAFKA__BOOTSTRAP": kafka_broker.bootstrap,
            "BALLAST__REDIS__URL": redis_server.url,
            "BALLAST__AUTH__API_KEYS": f'{{"{API_KEY}": "{TENANT}", "{OTHER_KEY}": "globex"}}',
            "BALLAST__TELEMETRY__METRICS_PORT": "0",
        }
    )
    settings = BackfillSettings(
        port=0,
        topic=names["topic"],
        backfilled_topic=names["backfilled"],
        deadletter_topic=names["deadletter"],
        topic_partitions=1,
        group_id=names["group"],
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        router_address=router_app.address,
        router_api_key=API_KEY,
        replay_timeout_s=30,
        max_attempts=2,
        retry_backoff_s=0.2,
        busy_backoff_s=0.2,
        redis_prefix=names["prefix"],
        delivery_timeout_s=5,
    )
    app = await create_backfill(config, settings)
    yield app
    await app.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def handoff(kafka_broker, tmp_path_factory, names):
    handoff = HandOff(
        HandOffSettings(
            outbox_path=tmp_path_factory.mktemp("outbox") / "o.sqlite",
            bootstrap=kafka_broker.bootstrap,
            topic=names["topic"],
            topic_partitions=1,
            delivery_timeout_s=5,
        )
    )
    await handoff.start()
    yield handoff
    await handoff.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def backfill_stub(backfill_app):
    async with grpc.aio.insecure_channel(backfill_app.address, options=CHANNEL_OPTIONS) as channel:
        yield backfill_pb2_grpc.BackfillStub(channel)


def domain_request(text: str, session: str, model: str = "tiny", max_tokens: int = 24) -> InferenceRequest:
    return InferenceRequest(
        request_id=uuid.uuid4().hex,
        session_id=session,
        tenant=TENANT,
        model=model,
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
        tier="A",
        prompt=text,
    )


async def hand_off(handoff: HandOff, request: InferenceRequest, level=Level.RULES, received_at=None) -> str:
    ticket = make_ticket(request.tenant, request.request_id)
    record = degraded_request_pb(
        request,
        ticket=ticket,
        tier="A",
        level=level,
        reason="admission",
        degraded_text="a quick answer",
        degraded_by="rules",
        received_at=received_at or time.time(),
        origin="test",
    )
    await handoff.submit(kafka_key(request.session_id, ticket), record.SerializeToString())
    return ticket


def meta(key: str = API_KEY):
    return (("x-api-key", key),)


async def subscribe(stub, got: list, stop: asyncio.Event, **target):
    call = stub.Subscribe(backfill_pb2.SubscribeRequest(**target), metadata=meta(), timeout=60)
    try:
        async for answer in call:
            got.append(answer)
            if stop.is_set():
                break
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            raise
    finally:
        call.cancel()


async def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def test_degraded_requests_are_replayed_stored_and_pushed_exactly_once(
    backfill_app, backfill_stub, handoff, router_stub
):
    session = f"session-{uuid.uuid4().hex[:6]}"
    # Two subscriptions on the same session, open before anything is ready: each ticket must
    # reach exactly one of them.
    got_a, got_b, stop = [], [], asyncio.Event()
    subs = [
        asyncio.create_task(subscribe(backfill_stub, got_a, stop, session_id=session)),
        asyncio.create_task(subscribe(backfill_stub, got_b, stop, session_id=session)),
    ]
    await asyncio.sleep(0.5)
    original_at = time.time() - 120  # the request was degraded two minutes ago
    requests = [domain_request(f"{PROMPT} #{i}", session) for i in range(3)]
    tickets = [await hand_off(handoff, r, received_at=original_at + i) for i, r in enumerate(requests)]

    async def all_pushed():
        return len(got_a) + len(got_b) >= len(tickets)

    await wait_for(all_pushed, what="three answers pushed")
    await asyncio.sleep(1.5)  # any duplicate push would arrive by now
    stop.set()
    for task in subs:
        task.cancel()
    await asyncio.gather(*subs, return_exceptions=True)
    pushed = [a.ticket for a in got_a + got_b]
    assert sorted(pushed) == sorted(tickets), "each ticket pushed exactly once across subscriptions"

    # The better answer is the full model's greedy answer to the same request, via the router.
    for request, ticket in zip(requests, tickets):
        answer = await backfill_stub.GetAnswer(backfill_pb2.GetAnswerRequest(ticket=ticket), metadata=meta(), timeout=5)
        direct = await collect(router_stub, chat_request(request.prompt, max_tokens=24, raw_prompt=True), API_KEY)
        assert answer.text == direct.text and list(answer.token_ids) == direct.token_ids
        assert answer.tenant == TENANT and answer.session_id == session and answer.request_id == request.request_id
        assert answer.model == "tiny" and answer.model_version == direct.started.model_version
        assert answer.degraded_level == common_pb2.DEGRADATION_RULES and answer.degraded_text == "a quick answer"
        # Original timestamps are kept.
        assert abs(answer.received_at.ToSeconds() - (original_at + tickets.index(ticket))) <= 1
        assert answer.completed_at.ToSeconds() >= answer.received_at.ToSeconds() + 100

    # Another tenant sees nothing of it.
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await backfill_stub.GetAnswer(
            backfill_pb2.GetAnswerRequest(ticket=tickets[0]), metadata=meta(OTHER_KEY), timeout=5
        )
    assert denied.value.code() == grpc.StatusCode.NOT_FOUND
    # A later subscription gets nothing already pushed.
    late: list = []
    late_stop = asyncio.Event()
    late_task = asyncio.create_task(subscribe(backfill_stub, late, late_stop, session_id=session))
    await asyncio.sleep(1.0)
    late_task.cancel()
    await asyncio.gather(late_task, return_exceptions=True)
    assert late == []

    # Published to the backfilled topic too.
    names_topic = backfill_app.settings.backfilled_topic
    records = await asyncio.to_thread(read_topic, backfill_app.config.kafka.bootstrap, names_topic, 3)
    assert {r.key() for r in records} == {session.encode()}
    text = backfill_app.telemetry.render()
    assert 'ballast_backfill_processed_total{outcome="stored"} 3.0' in text
    assert "ballast_backfill_completion_lag_seconds_bucket" in text
    assert "ballast_backfill_current_lag_seconds" in text
    assert "ballast_backfill_replays_in_flight 0.0" in text  # every replay is over


async def test_a_redelivered_record_is_not_replayed_or_pushed_again(backfill_app, backfill_stub, handoff):
    session = f"session-{uuid.uuid4().hex[:6]}"
    request = domain_request(PROMPT, session, max_tokens=8)
    ticket = await hand_off(handoff, request)
    got: list = []
    stop = asyncio.Event()
    sub = asyncio.create_task(subscribe(backfill_stub, got, stop, ticket=ticket))
    await asyncio.wait_for(sub, 60)
    assert [a.ticket for a in got] == [ticket]
    # The same record again (a producer retry, a crash before the commit): idempotent.
    await hand_off(handoff, request)

    async def duplicate_seen():
        return 'ballast_backfill_processed_total{outcome="duplicate"}' in backfill_app.telemetry.render()

    await wait_for(duplicate_seen, what="the duplicate to be handled")
    again: list = []
    sub = asyncio.create_task(subscribe(backfill_stub, again, asyncio.Event(), ticket=ticket))
    await asyncio.wait_for(sub, 10)  # ends at once: the ticket was pushed already
    assert again == []


async def test_poison_records_are_dead_lettered(backfill_app, handoff):
    bad = domain_request(PROMPT, "poison-session", model="no-such-model")
    ticket = await hand_off(handoff, bad)
    await handoff.submit(b"garbage", b"\xff\x00 not a protobuf")
    deadletter = backfill_app.settings.deadletter_topic
    records = await asyncio.to_thread(read_topic, backfill_app.config.kafka.bootstrap, deadletter, 2, 60.0)
    assert len(records) == 2
    by_key = {r.key(): dict(r.headers()) for r in records}
    replay_failed = by_key[b"poison-session"]
    assert replay_failed[DLQ_ATTEMPTS_HEADER] == b"2"  # max_attempts
    assert b"NOT_FOUND" in replay_failed[DLQ_ERROR_HEADER]
    undecodable = by_key[b"garbage"]
    assert undecodable[DLQ_ATTEMPTS_HEADER] == b"0" and b"invalid" in undecodable[DLQ_ERROR_HEADER]
    # The consumer moved past them: a good record behind them is still served.
    good = domain_request(PROMPT, "after-poison", max_tokens=4)
    good_ticket = await hand_off(handoff, good)

    async def stored():
        return await backfill_app.store.get(good_ticket) is not None

    await wait_for(stored, what="the record after the poison ones")
    assert await backfill_app.store.get(ticket) is None
    assert "ballast_backfill_dead_lettered_total" in backfill_app.telemetry.render()


class ScriptedReplayer:
    """Answers replays from a script of errors, then succeeds."""

    def __init__(self, script):
        self.script = list(script)
        self.calls = 0

    async def replay(self, record):
        from services.common.degraded.codec import ReplayResult

        self.calls += 1
        if self.script:
            raise self.script.pop(0)
        return ReplayResult("better", [1, 2], common_pb2.FINISH_REASON_STOP, 3, 2, "tiny", "v1")

    async def close(self):
        pass


async def test_busy_or_down_pool_waits_without_spending_attempts(backfill_app):
    from services.backfill.consumer import Record
    from services.backfill.processor import Processor
    from services.backfill.replay import ReplayError, ReplayErrorKind

    settings = backfill_app.settings.model_copy(update={"max_attempts": 2})
    script = [
        ReplayError(ReplayErrorKind.BUSY, "full", retry_after_s=0.05),
        ReplayError(ReplayErrorKind.UNHEALTHY, "no live worker"),
        ReplayError(ReplayErrorKind.BUSY, "full"),
        ReplayError(ReplayErrorKind.FAILED, "INTERNAL: boom"),
    ]
    replayer = ScriptedReplayer(script)
    processor = Processor(settings, backfill_app.store, replayer, backfill_app.producer)
    request = domain_request(PROMPT, f"s-{uuid.uuid4().hex[:6]}")
    ticket = make_ticket(TENANT, request.request_id)
    record = degraded_request_pb(
        request,
        ticket=ticket,
        tier="A",
        level=Level.RULES,
        reason="deadline",
        degraded_text="x",
        degraded_by="rules",
        received_at=time.time(),
    )
    outcome = await processor.handle(Record("t", 0, 0, None, record.SerializeToString(), ()))
    assert outcome == "stored" and replayer.calls == 5
    # Only the real failure counted: one of two attempts.
    assert await backfill_app.store.attempts(ticket) == 1
    assert (await backfill_app.store.get(ticket)).text == "better"


async def test_the_membership_and_quarantine_watches_share_the_apps_one_etcd_session(backfill_app):
    assert backfill_app.etcd is not None and backfill_app.membership is not None
    assert backfill_app.quarantine_watch is not None
    assert backfill_app.membership.session is backfill_app.etcd
    assert backfill_app.quarantine_watch.session is backfill_app.etcd


async def test_replay_waiting_for_a_down_pool_wakes_when_etcd_shows_it_back(backfill_app):
    """The pool's return, seen in etcd, ends the wait at once instead of after the backoff."""
    from services.backfill.consumer import Record
    from services.backfill.processor import Processor
    from services.backfill.replay import ReplayError, ReplayErrorKind
    from services.common.membership import WorkerRecord, make_client, workers_prefix

    model = f"later-{uuid.uuid4().hex[:6]}"  # a model no worker serves yet
    watch = backfill_app.processor.pool_watch
    assert watch is not None and not watch.ready(model)
    settings = backfill_app.settings.model_copy(update={"busy_backoff_s": 30.0, "busy_backoff_max_s": 30.0})
    replayer = ScriptedReplayer([ReplayError(ReplayErrorKind.UNHEALTHY, "no live worker")])
    processor = Processor(settings, backfill_app.store, replayer, backfill_app.producer, pool_watch=watch)
    request = domain_request(PROMPT, f"s-{uuid.uuid4().hex[:6]}", model=model)
    ticket = make_ticket(TENANT, request.request_id)
    record = degraded_request_pb(
        request,
        ticket=ticket,
        tier="A",
        level=Level.RULES,
        reason="no_worker",
        degraded_text="x",
        degraded_by="rules",
        received_at=time.time(),
    )
    handling = asyncio.create_task(processor.handle(Record("t", 0, 0, None, record.SerializeToString(), ())))
    assert await poll(lambda: replayer.calls == 1, 15), "the processor never tried the replay"
    assert not handling.done() and replayer.calls == 1  # waiting out the down pool

    etcd_config = backfill_app.config.etcd
    client = make_client(etcd_config)
    await client.connect()
    key = f"{workers_prefix(etcd_config)}{model}-worker".encode()
    try:
        lease = await client.lease(10)
        worker = WorkerRecord(id=f"{model}-worker", address="127.0.0.1:1", model=model, model_version="v1")
        started = time.monotonic()
        await client.put(key, worker.to_json(), lease=lease)
        outcome = await asyncio.wait_for(handling, 10)
        assert outcome == "stored" and replayer.calls == 2
        assert time.monotonic() - started < 10  # far less than the 30 s backoff
    finally:
        await client.delete(key)
        await client.close()


async def test_router_wired_with_the_degrader(router_app, router_stub, kafka_broker, tmp_path):
    """The wiring the router adopts: Generate runs `degrader.run(pool_stream, ...)` around the runner."""
    from services.common.degraded.codec import decode_degraded
    from services.router.degrade.config import DegradeConfig
    from services.router.degrade.degrader import Degrader

    topic = f"wired-{uuid.uuid4().hex[:8]}"
    config = DegradeConfig(
        ladders={"tiny-unserved": ["tiny", "rules"], "tiny": ["missing-light", "rules"]},
        topic=topic,
        topic_partitions=1,
        outbox_path=str(tmp_path / "o.sqlite"),
    )
    labels: list[dict] = []
    degrader = Degrader(config, kafka_broker.bootstrap, on_fallback=labels.append)
    await degrader.start()
    servicer = router_app.servicer
    original = servicer.degrader
    servicer.degrader = degrader
    try:
        # "tiny-unserved" has no worker: the light rung ("tiny", a real worker) answers.
        light = await collect(
            router_stub,
            chat_request(PROMPT, model="tiny-unserved", max_tokens=12, raw_prompt=True, session_id="wired"),
            API_KEY,
        )
        direct = await collect(router_stub, chat_request(PROMPT, model="tiny", max_tokens=12, raw_prompt=True), API_KEY)
        assert light.started.model == "tiny" and light.text == direct.text
        assert light.finished.degradation == common_pb2.DEGRADATION_LIGHT_MODEL and light.finished.backfill_ticket
        assert direct.finished.degradation == common_pb2.DEGRADATION_NONE
        # Unserved request with no light pool either: the rules answer.
        degrader.ladder = type(degrader.ladder)({"tiny-unserved": ["missing-light", "rules"]})
        ruled = await collect(
            router_stub,
            chat_request("How much is the charger?", model="tiny-unserved", max_tokens=12, session_id="wired"),
            API_KEY,
        )
        assert ruled.started.model == "rules" and "charger" in ruled.text
        assert ruled.finished.degradation == common_pb2.DEGRADATION_RULES
        assert labels == [
            {"reason": "no_worker", "level": "light_model"},  # tiny-unserved -> tiny
            {"reason": "no_worker", "level": "light_model"},  # tiny-unserved -> missing-light
            {"reason": "no_worker", "level": "rules"},
        ]  # missing-light -> rules
        assert await degrader.handoff.wait_drained(15)
        records = await asyncio.to_thread(read_topic, kafka_broker.bootstrap, topic, 2)
        handed = [decode_degraded(r.value()) for r in records]
        assert [h.ticket for h in handed] == [light.finished.backfill_ticket, ruled.finished.backfill_ticket]
        assert handed[0].request.model == "tiny-unserved" and handed[0].tenant == TENANT
        assert handed[0].degraded_text == light.text
    finally:
        servicer.degrader = original
        await degrader.stop()
