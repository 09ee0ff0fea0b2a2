"""What happens to one degraded request: replay, store once, publish, or dead-letter.

The handler is idempotent per ticket, because Kafka may deliver a record twice (a rebalance, a
crash before the commit, a producer reset upstream): an answer already stored is never
replayed again, only re-announced. Waiting is not failing: a busy or down primary pool, an
unreachable Redis or broker, a refused API key all wait with backoff and never count as
attempts; only replays that fail on their own count (one whose worker died under it does),
and after `max_attempts` the record goes to the dead-letter topic. The handler returns only when the record is settled, and only then
does the consumer commit its offset.

Poison is never replayed: a request whose fingerprint the router quarantined (it killed
workers; see services.common.quarantine) is parked before a replay, and so is one the router
refuses as quarantined during a replay. Parking is dead-lettering with the cause
`quarantined`; every dead-lettered ticket is also listed in Redis for `ballast status`
(parked.py).

Each record is handled in a span that continues the trace of the request that degraded (its
`traceparent` header), so the replay through the router shows up in that request's trace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, TypeVar

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from redis.exceptions import RedisError

from ballast.v1 import backfill_pb2
from services.backfill.consumer import Record
from services.backfill.metrics import BackfillMetrics
from services.backfill.parked import ParkedTickets
from services.backfill.pool_watch import PrimaryPoolWatch
from services.backfill.replay import Replayer, ReplayError, ReplayErrorKind
from services.backfill.settings import BackfillSettings
from services.backfill.store import AnswerStore
from services.common import tracing
from services.common.degraded.codec import InvalidDegradedRequest, backfilled_answer_pb, decode_degraded, seconds
from services.common.kafka import AsyncProducer, DeliveryFailed
from services.common.quarantine import QuarantineStore, degraded_fingerprint
from services.common.degraded.topics import (
    BACKFILLED_CONTENT_TYPE,
    CONTENT_TYPE_HEADER,
    DLQ_ATTEMPTS_HEADER,
    DLQ_ERROR_HEADER,
    DLQ_SOURCE_HEADER,
)

log = logging.getLogger(__name__)
TRACER = tracing.tracer("backfill")
T = TypeVar("T")
# Failures of our own dependencies: wait and try again, never blame the request.
INFRA_ERRORS = (RedisError, OSError, DeliveryFailed, asyncio.TimeoutError)


class Processor:
    def __init__(
        self,
        settings: BackfillSettings,
        store: AnswerStore,
        replayer: Replayer,
        producer: AsyncProducer,
        metrics: BackfillMetrics | None = None,
        pool_watch: PrimaryPoolWatch | None = None,
        ensure_topics: Callable[[], Awaitable[object]] | None = None,
        quarantine: QuarantineStore | None = None,
        parked: ParkedTickets | None = None,
    ) -> None:
        """`ensure_topics` creates the topics the processor writes to when they are missing; it
        runs when a publish fails, since a broker replaced by a fresh one has lost them (the
        publish would otherwise time out again and again while replays wait behind it)."""
        self.settings = settings
        self._ensure_topics = ensure_topics
        # The routers' quarantine as etcd has it (followed by the app); None: never checked.
        self.quarantine = quarantine
        self.parked = parked
        self.pool_watch = pool_watch
        self.store = store
        self.replayer = replayer
        self.producer = producer
        self.metrics = metrics
        # Original timestamps of the records in hand, for the lag gauge.
        self._in_hand: dict[tuple[int, int], float] = {}
        # Bounds the replays on the router, not the records in hand: a record that is storing
        # its answer or waiting for the broker's ack does not hold a replay slot, so the pool
        # stays as busy as replay_concurrency allows (and its batches as large).
        self._replay_slots = asyncio.Semaphore(settings.replay_concurrency)
        self.replaying = 0

    def oldest_in_hand(self) -> float | None:
        return min(self._in_hand.values(), default=None)

    def _count(self, instrument: str, value: float = 1, **labels: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, instrument).add(value, labels)

    async def handle(self, record: Record) -> str:
        """Settles one record; returns the outcome (stored, duplicate or dead_lettered)."""
        with TRACER.start_as_current_span(
            "backfill.handle",
            context=tracing.context_from_headers(record.headers),
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "kafka",
                "messaging.destination.name": record.topic,
                "messaging.kafka.partition": record.partition,
                "messaging.kafka.offset": record.offset,
            },
        ) as span:
            outcome = await self._handle(record)
            span.set_attribute("ballast.outcome", outcome)
            return outcome

    async def _handle(self, record: Record) -> str:
        try:
            degraded = decode_degraded(record.value)
        except InvalidDegradedRequest as exc:
            # No retry can make an undecodable record usable: straight to the dead letters.
            await self._dead_letter(record, f"invalid: {exc}", attempts=0, cause="invalid")
            return "dead_lettered"
        where = (record.partition, record.offset)
        trace.get_current_span().set_attribute("ballast.ticket", degraded.ticket)
        self._in_hand[where] = seconds(degraded.received_at)
        try:
            return await self._settle(record, degraded)
        finally:
            self._in_hand.pop(where, None)

    async def _settle(self, record: Record, degraded: backfill_pb2.DegradedRequest) -> str:
        answer = await self._infra(lambda: self.store.get(degraded.ticket), "read the answer")
        if answer is not None:
            # Handled before (a redelivery): do not replay, but make sure it was announced.
            await self._publish(answer)
            self._count("processed", outcome="duplicate")
            return "duplicate"
        result = await self._replay(record, degraded)
        if result is None:
            return "dead_lettered"
        answer = backfilled_answer_pb(degraded, result)
        stored = await self._infra(lambda: self.store.put_once(answer), "store the answer")
        if not stored:
            answer = await self._infra(lambda: self.store.get(degraded.ticket), "read the answer") or answer
        await self._publish(answer)
        lag = time.time() - seconds(degraded.received_at)
        if self.metrics is not None:
            self.metrics.lag.record(max(0.0, lag))
        self._count("processed", outcome="stored" if stored else "duplicate")
        log.info("ticket %s backfilled %.1fs after the request (%s)", degraded.ticket, lag, degraded.reason)
        return "stored" if stored else "duplicate"

    def _quarantined(self, degraded: backfill_pb2.DegradedRequest) -> bool:
        return self.quarantine is not None and self.quarantine.get(degraded_fingerprint(degraded)) is not None

    async def _replay(self, record: Record, degraded: backfill_pb2.DegradedRequest):
        s = self.settings
        busy_wait = s.busy_backoff_s
        while True:
            if self._quarantined(degraded):
                # Checked before every try: a quarantine may arrive while this one waits.
                await self._dead_letter(
                    record,
                    "quarantined: the request killed the workers it ran on",
                    0,
                    cause="quarantined",
                    ticket=degraded.ticket,
                    tenant=degraded.tenant,
                )
                return None
            started = time.perf_counter()
            try:
                result = await self._replay_once(degraded)
            except ReplayError as error:
                self._count("replays", result=error.kind.value)
                if error.kind is ReplayErrorKind.QUARANTINED:
                    await self._dead_letter(
                        record, str(error), 0, cause="quarantined", ticket=degraded.ticket, tenant=degraded.tenant
                    )
                    return None
                if error.kind is ReplayErrorKind.FAILED:
                    attempts = await self._infra(lambda: self.store.add_attempt(degraded.ticket), "count the attempt")
                    if attempts >= s.max_attempts:
                        await self._dead_letter(
                            record,
                            str(error),
                            attempts,
                            cause="attempts",
                            ticket=degraded.ticket,
                            tenant=degraded.tenant,
                        )
                        return None
                    wait = min(s.retry_backoff_max_s, s.retry_backoff_s * 2 ** (attempts - 1))
                    log.warning(
                        "replay of ticket %s failed (attempt %d of %d): %s; again in %.1fs",
                        degraded.ticket,
                        attempts,
                        s.max_attempts,
                        error,
                        wait,
                    )
                    await asyncio.sleep(wait)
                    continue
                if error.kind is ReplayErrorKind.CONFIG:
                    log.error("replays are refused by the router (%s): fix backfill.router_api_key", error)
                # Busy or down: back off (honouring the router's hint), never count an attempt.
                wait = min(max(busy_wait, error.retry_after_s or 0.0), s.busy_backoff_max_s)
                if error.kind is ReplayErrorKind.UNHEALTHY and self.pool_watch is not None:
                    if await self.pool_watch.wait_ready(degraded.request.model, wait):
                        busy_wait = s.busy_backoff_s  # the pool is back: try now, from the start
                        continue
                else:
                    await asyncio.sleep(wait)
                busy_wait = min(s.busy_backoff_max_s, busy_wait * 2)
                continue
            self._count("replays", result="ok")
            if self.metrics is not None:
                self.metrics.replay_latency.record((time.perf_counter() - started) * 1000)
            return result

    async def _replay_once(self, degraded: backfill_pb2.DegradedRequest):
        """One replay through the router, in one of the replay slots (backoffs wait outside)."""
        async with self._replay_slots:
            self.replaying += 1
            try:
                return await self.replayer.replay(degraded)
            finally:
                self.replaying -= 1

    async def _renew_producer(self) -> None:
        """A producer that lost every broker is replaced before it sends (the broker may be a
        fresh one that forgot its id, and the topics with it)."""
        if await self.producer.renew_if_stale() and self._ensure_topics is not None:
            await self._ensure_topics()

    async def _publish(self, answer: backfill_pb2.BackfilledAnswer) -> None:
        """Publishes to the backfilled topic (at least once per ticket; consumers key by ticket)."""
        await self._renew_producer()
        key = (answer.session_id or answer.ticket).encode()
        headers = [(CONTENT_TYPE_HEADER, BACKFILLED_CONTENT_TYPE)]
        await self._infra(
            lambda: self.producer.send(self.settings.backfilled_topic, answer.SerializeToString(), key, headers),
            "publish the answer",
            reset_producer=True,
        )

    async def _dead_letter(
        self, record: Record, error: str, attempts: int, cause: str, ticket: str = "", tenant: str = ""
    ) -> None:
        headers = [
            *record.headers,
            (DLQ_ERROR_HEADER, error[:1000].encode()),
            (DLQ_ATTEMPTS_HEADER, str(attempts).encode()),
            (DLQ_SOURCE_HEADER, f"{record.topic}/{record.partition}/{record.offset}".encode()),
        ]
        await self._renew_producer()
        await self._infra(
            lambda: self.producer.send(self.settings.deadletter_topic, record.value or b"", record.key, headers),
            "dead-letter the record",
            reset_producer=True,
        )
        if self.parked is not None:
            parked = self.parked
            await self._infra(
                lambda: parked.add(
                    ticket or f"{record.topic}/{record.partition}/{record.offset}", tenant, cause, attempts, error
                ),
                "list the parked ticket",
            )
        self._count("dead_lettered", cause=cause)
        self._count("processed", outcome="dead_lettered")
        log.error(
            "dead-lettered %s/%d@%d after %d attempts: %s",
            record.topic,
            record.partition,
            record.offset,
            attempts,
            error,
        )

    async def _infra(self, call: Callable[[], Awaitable[T]], what: str, reset_producer: bool = False) -> T:
        """Runs a call on Redis or Kafka until it works, backing off while they are away."""
        backoff = 0.5
        warned = False
        while True:
            generation = self.producer.resets
            try:
                return await call()
            except INFRA_ERRORS as exc:
                if not warned:
                    log.warning("cannot %s (%r); retrying until it works", what, exc)
                    warned = True
                # One reset per failure: a reset fails every record in flight, and if each of
                # those reset again, concurrent publishes would keep failing one another.
                if reset_producer and self.producer.resets == generation:
                    if self._ensure_topics is not None:
                        await self._ensure_topics()
                    await self.producer.reset()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
