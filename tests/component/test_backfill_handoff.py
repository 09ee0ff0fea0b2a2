"""The router side of backfill: the Degrader's ladder over fake pools, and the durable hand-off
to a real Kafka-protocol broker (outbox first; broker down → outbox fills → drained in order)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from ballast.v1 import common_pb2
from services.common.degraded.codec import decode_degraded, make_ticket
from services.common.degraded.codec import Level
from services.common.errors import InvalidArgument, NoLiveWorker, ResourceExhausted, RetryBudgetExhausted, Unavailable
from services.common.generation import FinishReason, Sampling
from services.cli.localservers import KafkaBroker
from services.router.degrade.config import DegradeConfig
from services.router.degrade.degrader import Degrader
from services.router.degrade.handoff import HandOff, HandOffSettings
from services.router.degrade.ladder import Reason
from services.router.degrade.outbox import OutboxFull
from services.router.events import Finished, Started, Tokens
from services.router.events_pb import event_to_pb
from services.router.requests import InferenceRequest, Message
from services.router.structured import check_schema
from tests.polling import poll

pytestmark = pytest.mark.asyncio(loop_scope="session")


def make_request(
    text: str = "Is the phone case in stock?", session: str = "s-1", request_id: str = "", allow_degraded: bool = True
) -> InferenceRequest:
    return InferenceRequest(
        request_id=request_id or uuid.uuid4().hex,
        session_id=session,
        tenant="acme",
        model="big",
        sampling=Sampling(max_tokens=16, temperature=0.0),
        tier="A",
        messages=(Message("user", text),),
        allow_degraded=allow_degraded,
    )


def read_topic(bootstrap: str, topic: str, count: int, timeout_s: float = 20.0):
    """Reads `count` records from the start of every partition (no group join: fast)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "log_level": 2,
        }
    )
    try:
        deadline = time.monotonic() + timeout_s
        partitions: list[int] = []
        while not partitions and time.monotonic() < deadline:
            metadata = consumer.list_topics(topic, timeout=5)
            partitions = list(metadata.topics[topic].partitions) if topic in metadata.topics else []
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        records = []
        while len(records) < count and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is not None and message.error() is None:
                records.append(message)
        return records
    finally:
        consumer.close()


class FakePools:
    """Pool streams by model: an exception to raise, or events to yield."""

    def __init__(self, behaviour: dict[str, object]) -> None:
        self.behaviour = behaviour
        self.calls: list[str] = []

    def stream(self, request):
        return self._stream(request)

    async def _stream(self, request):
        self.calls.append(request.model)
        plan = self.behaviour[request.model]
        if isinstance(plan, BaseException):
            raise plan
        for event in plan:
            if isinstance(event, BaseException):
                raise event
            yield event


def model_events(model: str, text: str, ids: list[int]):
    """What the runner yields for a served request (plain events, as the ladder relays them)."""
    return [
        Started(request_id="", tier="A", tier_reason="default", model=model, model_version="v1"),
        Tokens(text=text, token_ids=ids, first_index=0),
        Finished(FinishReason.STOP, prompt_tokens=3, completion_tokens=len(ids), resumes=0),
    ]


async def run_all(degrader: Degrader, pools: FakePools, request: InferenceRequest):
    events = []
    async for event in degrader.run(
        pools.stream,
        request,
        tier="A",
        tier_reason="default",
        deadline=time.monotonic() + 30,
        started=time.perf_counter(),
    ):
        events.append(event_to_pb(event))  # as the client receives it
    return events


@pytest.fixture
def topic():
    return f"degraded-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def degrader(tmp_path, kafka_broker, topic):
    config = DegradeConfig(
        ladders={"big": ["small", "rules"]},
        topic=topic,
        topic_partitions=1,
        outbox_path=str(tmp_path / "outbox.sqlite"),
        delivery_timeout_s=3,
    )
    fallbacks: list[dict[str, str]] = []
    degrader = Degrader(config, kafka_broker.bootstrap, on_fallback=fallbacks.append)
    degrader.fallbacks = fallbacks
    await degrader.start()
    yield degrader
    await degrader.stop()


# -- the ladder over fake pools --------------------------------------------------------------


async def test_decide_is_a_pure_function_of_error_request_and_position():
    degrader = Degrader(DegradeConfig(ladders={"big": ["small", "rules"]}, handoff=False), "unused:1")
    request = make_request()
    light = degrader.decide(ResourceExhausted("queue full"), request)
    assert (light.reason, light.rung.level, light.rung.model, light.index) == (
        Reason.ADMISSION,
        Level.LIGHT_MODEL,
        "small",
        0,
    )
    rules = degrader.decide(NoLiveWorker("no live worker for model 'small'"), request, after=0)
    assert (rules.reason, rules.rung.level) == (Reason.NO_WORKER, Level.RULES)
    assert degrader.decide(Unavailable("x"), request, after=1) is None  # nothing below rules
    assert degrader.decide(InvalidArgument("bad"), request) is None  # client errors never degrade
    assert degrader.decide(ResourceExhausted("full"), replace(request, allow_degraded=False)) is None
    # Too little time left for the light model: straight to the rules.
    assert degrader.decide(ResourceExhausted("full"), request, remaining_s=0.2).rung.level is Level.RULES
    assert degrader.decide(RetryBudgetExhausted("spent"), request).reason is Reason.RETRY_BUDGET
    assert degrader.decide(Unavailable("worker w1 failed: INTERNAL"), request).reason is Reason.WORKER_FAILED
    off = Degrader(DegradeConfig(enabled=False, handoff=False), "unused:1")
    assert off.decide(ResourceExhausted("full"), request) is None


async def test_bad_ladders_are_rejected_naming_the_entry():
    with pytest.raises(ValueError, match=r"ladders.big\[1\]"):
        DegradeConfig(ladders={"big": ["rules", "small"]})
    with pytest.raises(ValueError, match="itself"):
        DegradeConfig(ladders={"big": ["big", "rules"]})


async def test_primary_success_passes_through_untouched(degrader):
    pools = FakePools({"big": model_events("big", "hello", [1, 2])})
    events = await run_all(degrader, pools, make_request())
    assert [e.WhichOneof("event") for e in events] == ["started", "tokens", "finished"]
    assert events[-1].finished.degradation == common_pb2.DEGRADATION_NONE
    assert not events[-1].finished.backfill_ticket


async def test_light_model_answers_marked_with_a_ticket(degrader, kafka_broker, topic):
    # The primary got as far as Started, then failed before any token: its Started is dropped.
    primary = [model_events("big", "", [])[0], NoLiveWorker("no live worker for model 'big'")]
    pools = FakePools({"big": primary, "small": model_events("small", "light answer", [5, 6, 7])})
    request = make_request(session="s-light")
    events = await run_all(degrader, pools, request)
    assert [e.WhichOneof("event") for e in events] == ["started", "tokens", "finished"]
    assert events[0].started.model == "small"
    finished = events[-1].finished
    assert finished.degradation == common_pb2.DEGRADATION_LIGHT_MODEL
    assert finished.backfill_ticket == make_ticket("acme", request.request_id)
    assert degrader.fallbacks == [{"reason": "no_worker", "level": "light_model"}]
    assert await degrader.handoff.wait_drained(15)
    (record,) = await asyncio.to_thread(read_topic, kafka_broker.bootstrap, topic, 1)
    assert record.key() == b"s-light"
    degraded = decode_degraded(record.value())
    assert degraded.ticket == finished.backfill_ticket and degraded.tenant == "acme"
    assert degraded.level == common_pb2.DEGRADATION_LIGHT_MODEL and degraded.reason == "no_worker"
    assert degraded.degraded_text == "light answer" and degraded.degraded_by == "small"
    assert (
        degraded.request.model == "big"
        and degraded.request.conversation.messages[0].content == request.messages[0].content
    )
    assert degraded.request.sampling.max_tokens == 16
    assert abs(degraded.received_at.ToSeconds() - time.time()) < 30


async def test_rules_answer_after_both_pools_fail(degrader, kafka_broker, topic):
    pools = FakePools(
        {"big": ResourceExhausted("queue full"), "small": NoLiveWorker("no live worker for model 'small'")}
    )
    request = make_request("我的手机壳有货吗？", session="s-rules")
    events = await run_all(degrader, pools, request)
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished" and set(kinds[1:-1]) == {"tokens"}
    assert events[0].started.model == "rules"
    text = "".join(e.tokens.text for e in events if e.HasField("tokens"))
    assert "手机壳" in text and "库存" in text
    assert events[-1].finished.degradation == common_pb2.DEGRADATION_RULES
    assert degrader.fallbacks == [
        {"reason": "admission", "level": "light_model"},
        {"reason": "no_worker", "level": "rules"},
    ]
    assert await degrader.handoff.wait_drained(15)
    (record,) = await asyncio.to_thread(read_topic, kafka_broker.bootstrap, topic, 1)
    degraded = decode_degraded(record.value())
    # The hand-off keeps why it left the primary pool, and what finally answered.
    assert degraded.reason == "admission" and degraded.level == common_pb2.DEGRADATION_RULES
    assert degraded.degraded_text == text and degraded.degraded_by == "rules"


async def test_a_rules_answer_to_a_json_request_is_a_document_of_its_schema(degrader):
    schema = check_schema(
        json.dumps(
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["status", "order_id"],
                "properties": {"status": {"enum": ["shipped", "pending"]}, "order_id": {"type": "string"}},
            }
        )
    )
    pools = FakePools({"big": NoLiveWorker("no live worker for model 'big'"), "small": NoLiveWorker("no live worker")})
    events = await run_all(degrader, pools, replace(make_request("Has order 7 shipped?"), schema=schema))
    text = "".join(e.tokens.text for e in events if e.HasField("tokens"))
    finished = events[-1].finished
    assert finished.degradation == common_pb2.DEGRADATION_RULES
    # What streamed is the document itself, it conforms, and it is marked as filled in.
    assert json.loads(text) == {"status": "shipped", "order_id": ""} and schema.is_valid(json.loads(text))
    assert finished.structured_status == common_pb2.STRUCTURED_REPAIRED
    assert finished.structured_output == text and finished.structured_repairs


async def test_no_degradation_when_not_allowed_or_after_tokens(degrader):
    pools = FakePools({"big": ResourceExhausted("queue full"), "small": model_events("small", "x", [1])})
    with pytest.raises(ResourceExhausted):
        await run_all(degrader, pools, make_request(allow_degraded=False))
    assert pools.calls == ["big"]
    started, tokens, _ = model_events("big", "partial", [1, 2])
    pools = FakePools(
        {"big": [started, tokens, Unavailable("worker w1 failed")], "small": model_events("small", "x", [1])}
    )
    with pytest.raises(Unavailable):
        await run_all(degrader, pools, make_request())
    assert pools.calls == ["big"]


def small_tokenizer():
    """A byte-level BPE trained in milliseconds, like the models' own tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the current price of the charger is shown on its product page"] * 20, trainer)
    return tokenizer


async def test_rules_tokens_use_the_models_tokenizer_when_given(degrader):
    tokenizer = small_tokenizer()
    degrader.encoder_for = lambda model: tokenizer if model == "big" else None
    pools = FakePools({"big": NoLiveWorker("no live worker for model 'big'"), "small": NoLiveWorker("no live worker")})
    events = await run_all(degrader, pools, make_request("How much is the charger?"))
    tokens = [e.tokens for e in events if e.HasField("tokens")]
    ids = [i for t in tokens for i in t.token_ids]
    text = "".join(t.text for t in tokens)
    assert ids == tokenizer.encode(text).ids
    assert [t.first_index for t in tokens] == [sum(len(x.token_ids) for x in tokens[:i]) for i in range(len(tokens))]
    assert events[-1].finished.usage.completion_tokens == len(ids)


# -- the outbox while the broker is away -----------------------------------------------------


async def test_broker_down_fills_the_outbox_and_back_drains_in_order(tmp_path, tmp_path_factory):
    broker = KafkaBroker(tmp_path_factory.mktemp("kafka-outage")).start()
    topic = "ballast.degraded.v1"
    handoff = HandOff(
        HandOffSettings(
            outbox_path=tmp_path / "outbox.sqlite",
            bootstrap=broker.bootstrap,
            topic=topic,
            topic_partitions=1,
            max_rows=12,
            delivery_timeout_s=2,
            backoff_initial_s=0.2,
            backoff_max_s=1.0,
        )
    )
    await handoff.start()
    try:
        await handoff.submit(b"s", b"before-0")
        assert await handoff.wait_drained(15)
        await asyncio.to_thread(broker.stop)
        values = [f"during-{i}".encode() for i in range(10)]
        # Concurrent submits share commits; each returns once its row is on disk.
        await asyncio.gather(*(handoff.submit(b"s", v) for v in values))
        assert handoff.depth().rows == 10
        # The drainer tries, fails, backs off: nothing is lost meanwhile.
        assert await poll(lambda: not handoff.stats.broker_up, 15), "the drainer never noticed the broker gone"
        assert handoff.depth().rows == 10
        await handoff.submit(b"s", b"during-10")
        await handoff.submit(b"s", b"during-11")
        with pytest.raises(OutboxFull):
            await handoff.submit(b"s", b"refused")  # bounded: refused loudly, never grown
        assert handoff.stats.refused == 1
        await asyncio.to_thread(broker.restart)
        assert await handoff.wait_drained(30), handoff.stats
        # Memory storage: the broker came back empty, so the topic holds exactly what waited.
        records = await asyncio.to_thread(read_topic, broker.bootstrap, topic, 12)
        assert [r.value() for r in records] == values + [b"during-10", b"during-11"]
        assert handoff.stats.broker_up
    finally:
        await handoff.stop()
        broker.stop()


async def test_outbox_left_by_a_crash_is_drained_by_the_next_start(tmp_path, kafka_broker, topic):
    from services.router.degrade.outbox import Outbox

    path = tmp_path / "outbox.sqlite"
    with Outbox(path) as outbox:  # what a router that crashed before draining left behind
        outbox.append([(b"s", b"left-0"), (b"s", b"left-1")])
    handoff = HandOff(
        HandOffSettings(
            outbox_path=path, bootstrap=kafka_broker.bootstrap, topic=topic, topic_partitions=1, delivery_timeout_s=3
        )
    )
    await handoff.start()
    try:
        assert await handoff.wait_drained(15)
        records = await asyncio.to_thread(read_topic, kafka_broker.bootstrap, topic, 2)
        assert [r.value() for r in records] == [b"left-0", b"left-1"]
    finally:
        await handoff.stop()


async def test_full_outbox_still_answers_but_without_a_ticket(tmp_path, kafka_broker):
    config = DegradeConfig(outbox_path=str(tmp_path / "o.sqlite"), outbox_max_rows=1, delivery_timeout_s=2)
    # An unreachable broker keeps the outbox full.
    degrader = Degrader(config, "127.0.0.1:1")
    await degrader.start()
    try:
        pools = FakePools({"big": ResourceExhausted("full")})
        first = await run_all(degrader, pools, make_request())
        assert first[-1].finished.backfill_ticket
        second = await run_all(degrader, pools, make_request())
        assert second[-1].finished.degradation == common_pb2.DEGRADATION_RULES
        assert second[-1].finished.backfill_ticket == ""
        assert degrader.handoffs_refused == 1
    finally:
        config_stop = degrader.config.model_copy(update={"stop_drain_s": 0})
        degrader.config = config_stop
        await degrader.stop()
