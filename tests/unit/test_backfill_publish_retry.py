"""A failed publish of the backfill re-creates missing topics before the producer is replaced:
a broker replaced by a fresh one has lost them, and every retry would time out again."""

from __future__ import annotations

from services.backfill.processor import Processor
from services.backfill.settings import BackfillSettings
from services.degrade.kafka import DeliveryFailed


class Producer:
    def __init__(self, log: list[str]) -> None:
        self.resets = 0
        self.log = log

    async def reset(self) -> None:
        self.resets += 1
        self.log.append("reset")


async def test_a_failed_publish_ensures_the_topics_then_resets_and_retries():
    log: list[str] = []

    async def ensure_topics() -> bool:
        log.append("ensure")
        return True

    processor = Processor(BackfillSettings(), store=None, replayer=None, producer=Producer(log),
                          ensure_topics=ensure_topics)
    attempts = iter([DeliveryFailed("_MSG_TIMED_OUT"), "delivered"])

    async def publish():
        outcome = next(attempts)
        log.append(f"publish:{outcome}" if isinstance(outcome, str) else "publish:failed")
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert await processor._infra(publish, "publish the answer", reset_producer=True) == "delivered"
    assert log == ["publish:failed", "ensure", "reset", "publish:delivered"]


async def test_store_failures_touch_neither_topics_nor_producer():
    log: list[str] = []

    async def ensure_topics() -> bool:
        log.append("ensure")
        return True

    processor = Processor(BackfillSettings(), store=None, replayer=None, producer=Producer(log),
                          ensure_topics=ensure_topics)
    attempts = iter([ConnectionError("redis away"), "stored"])

    async def store():
        outcome = next(attempts)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert await processor._infra(store, "store the answer") == "stored"
    assert log == []
