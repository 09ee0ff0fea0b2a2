"""A failed publish of the backfill re-creates missing topics before the producer is replaced:
a broker replaced by a fresh one has lost them, and every retry would time out again."""

from __future__ import annotations

from services.backfill.processor import Processor
from services.backfill.settings import BackfillSettings
from services.common.kafka import DeliveryFailed


class Producer:
    def __init__(self, log: list[str]) -> None:
        self.resets = 0
        self.log = log

    async def reset(self) -> None:
        self.resets += 1
        self.log.append("reset")


def processor_logging_to(log: list[str]) -> Processor:
    async def ensure_topics() -> bool:
        log.append("ensure")
        return True

    return Processor(BackfillSettings(), store=None, replayer=None, producer=Producer(log), ensure_topics=ensure_topics)


def failing_once(error: Exception, result: str, log: list[str]):
    """A call that raises `error` the first time and returns `result` the second."""
    attempts = iter([error, result])

    async def call():
        outcome = next(attempts)
        log.append("call:failed" if isinstance(outcome, Exception) else f"call:{outcome}")
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return call


async def test_a_failed_publish_ensures_the_topics_then_resets_and_retries():
    log: list[str] = []
    processor = processor_logging_to(log)
    publish = failing_once(DeliveryFailed("_MSG_TIMED_OUT"), "delivered", log)

    assert await processor._infra(publish, "publish the answer", reset_producer=True) == "delivered"
    assert log == ["call:failed", "ensure", "reset", "call:delivered"]


async def test_store_failures_touch_neither_topics_nor_producer():
    log: list[str] = []
    processor = processor_logging_to(log)
    store = failing_once(ConnectionError("redis away"), "stored", log)

    assert await processor._infra(store, "store the answer") == "stored"
    assert log == ["call:failed", "call:stored"]
