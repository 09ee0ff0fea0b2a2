"""The backfill's Kafka check against a real broker: an outage shorter than the metadata call's
timeout still shows, and when the broker is back the stale producer is replaced at once."""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import KafkaException

from services.backfill.kafka_check import KafkaCheck, admin_client
from services.common.kafka import AsyncProducer, Delivered
from services.cli.localservers import KafkaBroker
from tests.component.test_kafka_producer import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

METADATA_TIMEOUT_S = 5.0
OUTAGE_S = 4.0  # shorter than the metadata call's timeout


async def test_a_short_outage_fails_the_check_and_the_producer_is_renewed_after_it(tmp_path_factory):
    broker = KafkaBroker(tmp_path_factory.mktemp("kafka-check")).start()
    producer = AsyncProducer(broker.bootstrap, 4.0, "test-check")
    await producer.start()
    renewed: list[bool] = []

    async def on_renewed() -> None:
        renewed.append(True)

    check = KafkaCheck(admin_client(broker.bootstrap), producer, METADATA_TIMEOUT_S, on_renewed)
    try:
        await check()  # reachable
        assert isinstance(await producer.send("check.t", b"before", b"k"), Delivered)
        await asyncio.to_thread(broker.stop)
        assert await wait_for(lambda: producer.lost_brokers), "librdkafka never reported losing the broker"

        async def come_back() -> None:
            await asyncio.sleep(OUTAGE_S)
            await asyncio.to_thread(broker.restart)

        back = asyncio.create_task(come_back())
        # A plain metadata call would wait for the broker and pass once it is back.
        with pytest.raises(KafkaException):
            await check()
        assert not back.done() and renewed == []
        await back

        async def passes() -> bool:
            try:
                await check()
                return True
            except KafkaException:
                return False

        for _ in range(40):
            if await passes():
                break
            await asyncio.sleep(0.5)
        assert renewed == [True]  # the stale producer was replaced as soon as the broker answered
        assert producer.resets == 1 and not producer.lost_brokers
        await check()  # and a healthy producer is left alone
        assert renewed == [True] and producer.resets == 1
    finally:
        await producer.stop()
        broker.stop()
