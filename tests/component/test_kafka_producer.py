"""The asyncio Kafka producer against a real broker: a broker replaced by a fresh one (which
forgets every producer id) must not leave the producer's next records hanging until they time
out, and records of a replaced producer must fail at once, not wait for a report nobody serves.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.kafka import AsyncProducer, Delivered, DeliveryFailed
from services.cli.localservers import KafkaBroker
from tests.component.test_backfill_handoff import read_topic

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Short, so that a producer stuck on a forgotten id fails within the test instead of delivering.
DELIVERY_TIMEOUT_S = 4.0


async def wait_for(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


async def test_a_producer_that_lost_its_broker_delivers_to_the_fresh_one_without_a_failure(tmp_path_factory):
    broker = KafkaBroker(tmp_path_factory.mktemp("kafka-replaced")).start()
    producer = AsyncProducer(broker.bootstrap, DELIVERY_TIMEOUT_S, "test-replaced")
    await producer.start()
    try:
        assert isinstance(await producer.send("replaced.t", b"before", b"k"), Delivered)
        assert not producer.lost_brokers
        await asyncio.to_thread(broker.stop)
        assert await wait_for(lambda: producer.lost_brokers), "librdkafka never reported losing the broker"
        await asyncio.to_thread(broker.restart)  # memory storage: a broker that knows no producer id

        # The old producer's next record (sequence 1 of an id the broker never issued) would wait
        # out the delivery timeout and fail; the fresh producer's is delivered.
        delivered = await producer.send("replaced.t", b"after", b"k")

        assert isinstance(delivered, Delivered)
        assert producer.resets == 1 and not producer.lost_brokers
        records = await asyncio.to_thread(read_topic, broker.bootstrap, "replaced.t", 1)
        assert [r.value() for r in records] == [b"after"]
    finally:
        await producer.stop()
        broker.stop()


async def test_a_producer_that_never_lost_its_broker_is_kept(kafka_broker):
    producer = AsyncProducer(kafka_broker.bootstrap, DELIVERY_TIMEOUT_S, "test-kept")
    await producer.start()
    try:
        for i in range(3):
            assert isinstance(await producer.send("kept.t", f"r{i}".encode(), b"k"), Delivered)
        assert not await producer.renew_if_stale()
        assert producer.resets == 0
    finally:
        await producer.stop()


async def test_replacing_a_producer_fails_its_unreported_records_at_once(tmp_path_factory):
    broker = KafkaBroker(tmp_path_factory.mktemp("kafka-purged")).start()
    producer = AsyncProducer(broker.bootstrap, 30.0, "test-purged")
    await producer.start()
    try:
        await asyncio.to_thread(broker.stop)  # nothing can be acknowledged now
        futures = [producer.send_nowait("purged.t", f"r{i}".encode(), b"k") for i in range(5)]
        await asyncio.sleep(0.2)
        assert not any(f.done() for f in futures)

        await producer.reset()

        # Resolved by the time reset() returns, 30 s before their delivery timeout.
        assert all(f.done() for f in futures)
        assert all(isinstance(f.exception(), DeliveryFailed) for f in futures)
    finally:
        await producer.stop()
        broker.stop()


async def test_overlapping_resets_leave_no_record_without_an_answer(kafka_broker):
    """Two failing callers may reset at once while others send: every record still gets a
    delivery report (delivered, or failed by the purge), none waits in a producer nobody polls."""
    producer = AsyncProducer(kafka_broker.bootstrap, DELIVERY_TIMEOUT_S, "test-overlap")
    await producer.start()
    try:
        futures = []

        async def sender() -> None:
            for i in range(60):
                futures.append(producer.send_nowait("overlap.t", f"r{i}".encode(), b"k"))
                await asyncio.sleep(0)

        await asyncio.gather(sender(), producer.reset(), producer.reset())
        outcomes = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), DELIVERY_TIMEOUT_S + 5)
        assert all(isinstance(o, (Delivered, DeliveryFailed)) for o in outcomes)
        assert not [o for o in outcomes if isinstance(o, DeliveryFailed) and "stopped" in str(o)]
        assert producer.resets == 2
        assert isinstance(await producer.send("overlap.t", b"after", b"k"), Delivered)
    finally:
        await producer.stop()
