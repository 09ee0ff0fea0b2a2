"""The backfill's replay slots bound replays on the router, not records in hand: a record that
stores its answer or waits for the broker's ack has given its slot to the next replay."""

from __future__ import annotations

import asyncio

from ballast.v1 import backfill_pb2, inference_pb2
from services.backfill.consumer import Record
from services.backfill.processor import Processor
from services.backfill.settings import BackfillSettings
from services.common.degraded.codec import ReplayResult, make_ticket, timestamp

SLOTS = 3
RECORDS = 12


def degraded_record(i: int) -> Record:
    degraded = backfill_pb2.DegradedRequest(
        ticket=make_ticket("acme", f"req-{i}"),
        tenant="acme",
        session_id=f"s{i}",
        request=inference_pb2.GenerateRequest(model="tiny", prompt=f"question {i}"),
        received_at=timestamp(1_800_000_000 + i),
    )
    return Record("ballast.degraded.v1", 0, i, f"s{i}".encode(), degraded.SerializeToString(), ())


class Activity:
    """What runs at the same moment: replays, and publishes waiting for their ack."""

    def __init__(self) -> None:
        self.replaying = 0
        self.publishing = 0
        self.most_replaying = 0
        # Replays running while some other record waited for its publish ack.
        self.replays_beside_a_publish = 0


class SlowReplayer:
    def __init__(self, activity: Activity) -> None:
        self.activity = activity

    async def replay(self, degraded: backfill_pb2.DegradedRequest) -> ReplayResult:
        a = self.activity
        a.replaying += 1
        a.most_replaying = max(a.most_replaying, a.replaying)
        if a.publishing:
            a.replays_beside_a_publish += 1
        try:
            await asyncio.sleep(0.02)
        finally:
            a.replaying -= 1
        return ReplayResult(
            text=f"better {degraded.ticket}",
            token_ids=[1, 2],
            finish_reason=1,
            prompt_tokens=3,
            completion_tokens=2,
            model="tiny",
            model_version="1",
        )


class MemoryStore:
    def __init__(self) -> None:
        self.answers: dict[str, backfill_pb2.BackfilledAnswer] = {}

    async def get(self, ticket: str) -> backfill_pb2.BackfilledAnswer | None:
        return self.answers.get(ticket)

    async def put_once(self, answer: backfill_pb2.BackfilledAnswer) -> bool:
        await asyncio.sleep(0.005)
        return self.answers.setdefault(answer.ticket, answer) is answer


class SlowAckProducer:
    """Acks each record after a while, like a broker under load."""

    resets = 0

    def __init__(self, activity: Activity) -> None:
        self.activity = activity
        self.sent: list[bytes] = []

    async def renew_if_stale(self) -> bool:
        return False

    async def send(self, topic: str, value: bytes, key: bytes, headers) -> None:
        self.activity.publishing += 1
        try:
            await asyncio.sleep(0.05)
        finally:
            self.activity.publishing -= 1
        self.sent.append(key)


async def test_replays_are_bounded_by_the_slots_while_publishes_overlap_them():
    activity = Activity()
    store, producer = MemoryStore(), SlowAckProducer(activity)
    processor = Processor(BackfillSettings(replay_concurrency=SLOTS), store, SlowReplayer(activity), producer)

    outcomes = await asyncio.gather(*(processor.handle(degraded_record(i)) for i in range(RECORDS)))

    assert outcomes == ["stored"] * RECORDS
    assert len(store.answers) == RECORDS and len(producer.sent) == RECORDS
    assert activity.most_replaying == SLOTS  # every slot used, never more
    assert activity.replays_beside_a_publish > 0  # a waiting publish held no slot
    assert processor.replaying == 0


async def test_a_backoff_does_not_hold_a_replay_slot():
    """A record waiting out a busy pool leaves its slot to records that can replay now."""
    from services.backfill.replay import ReplayError, ReplayErrorKind

    activity = Activity()
    busy_once = {"left": 1}
    refused = asyncio.Event()

    class BusyFirst(SlowReplayer):
        async def replay(self, degraded):
            if degraded.ticket == make_ticket("acme", "req-0") and busy_once["left"]:
                busy_once["left"] -= 1
                refused.set()
                raise ReplayError(ReplayErrorKind.BUSY, "RESOURCE_EXHAUSTED: full", retry_after_s=1.0)
            return await super().replay(degraded)

    # A backoff many times longer than a replay (its fakes sleep a few tens of ms).
    settings = BackfillSettings(replay_concurrency=1, busy_backoff_s=1.0, busy_backoff_max_s=1.0)
    store = MemoryStore()
    processor = Processor(settings, store, BusyFirst(activity), SlowAckProducer(activity))

    first = asyncio.create_task(processor.handle(degraded_record(0)))
    await refused.wait()  # record 0 was refused and is backing off
    # With the only slot free, record 1 replays and is stored before record 0 tries again.
    assert await processor.handle(degraded_record(1)) == "stored"
    assert make_ticket("acme", "req-0") not in store.answers
    assert await first == "stored"
