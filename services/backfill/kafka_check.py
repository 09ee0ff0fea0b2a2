"""The backfill's Kafka reachability check, which also sees outages shorter than its timeout.

A metadata call alone misses a short outage: it waits up to its timeout for the broker, and a
broker back within that time answers it. The producer knows sooner: librdkafka reports when
it has lost every broker. So while the producer says so, the metadata call gets a short
timeout and fails during the outage; once the broker answers again, the stale producer is
replaced at once (not at its next send) and the topics are checked, since a fresh broker may
have lost them.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Mapping

from confluent_kafka.admin import AdminClient

from services.common.kafka import AsyncProducer

# The metadata call's timeout while the producer reports every broker lost: short, so an
# outage of a few seconds shows in health and metrics.
LOST_BROKER_TIMEOUT_S = 1.0


def admin_client(bootstrap: str, security: Mapping[str, str] | None = None) -> AdminClient:
    # Reconnect soon after the broker is back: the check should not report an outage that is over.
    return AdminClient(
        {"bootstrap.servers": bootstrap, "log_level": 2, "reconnect.backoff.max.ms": 1000, **(security or {})}
    )


class KafkaCheck:
    """Raises while the broker is unreachable; a DependencyProbe calls it."""

    def __init__(
        self, admin: AdminClient, producer: AsyncProducer, timeout_s: float, on_renewed: Callable[[], Awaitable[object]]
    ) -> None:
        self.admin = admin
        self.producer = producer
        self.timeout_s = timeout_s
        self._on_renewed = on_renewed

    async def __call__(self) -> None:
        lost = self.producer.lost_brokers
        timeout_s = min(LOST_BROKER_TIMEOUT_S, self.timeout_s) if lost else self.timeout_s
        # librdkafka calls block: keep them off the event loop.
        await asyncio.to_thread(self.admin.list_topics, timeout=timeout_s)
        if lost and await self.producer.renew_if_stale():
            await self._on_renewed()
