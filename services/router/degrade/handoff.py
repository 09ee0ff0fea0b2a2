"""Durable hand-off of degraded requests: outbox first, then Kafka.

`submit()` returns only once the record is committed to the SQLite outbox, so the router can
send the client its ticket knowing a crash cannot lose the request. Concurrent submits share
one transaction (group commit: one fsync per batch, not per request). A drainer task produces
the outbox's rows in order with an idempotent, acks=all producer and deletes each row when its
delivery report arrives; while the broker is unreachable rows wait (bounded) and the drainer
retries with backoff, starting again from the oldest row.

Each record carries the trace context of the request that degraded (W3C `traceparent` header),
so the backfill's replay continues that request's trace. The context is kept in memory beside
the row, not in the outbox: rows drained after a restart go out without it (a trace link is
worth less than a schema change to the outbox).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from services.common import tracing
from services.common.degraded.topics import CONTENT_TYPE_HEADER, DEGRADED_CONTENT_TYPE, DEGRADED_TOPIC
from services.common.kafka import AsyncProducer, Delivered, DeliveryFailed, ensure_topics
from services.common.tasks import stop_task
from services.router.degrade.outbox import Outbox, OutboxDepth, OutboxError, OutboxFull, Synchronous

log = logging.getLogger(__name__)

__all__ = ["HandOff", "HandOffSettings", "HandOffStats", "OutboxFull", "OutboxError"]


@dataclass(frozen=True)
class HandOffSettings:
    outbox_path: Path
    bootstrap: str
    topic: str = DEGRADED_TOPIC
    topic_partitions: int = 3
    topic_replication: int = 1
    max_rows: int = 100_000
    max_bytes: int = 256 << 20
    synchronous: Synchronous = "FULL"
    # Submits waiting for the next outbox commit at most; more are refused.
    max_pending: int = 1024
    drain_batch: int = 100
    delivery_timeout_s: float = 10.0
    # SASL and TLS properties of the brokers (KafkaConfig.security_properties()).
    kafka_security: dict = field(default_factory=dict)
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    client_id: str = "ballast-router"
    headers: Sequence[tuple[str, bytes]] = ((CONTENT_TYPE_HEADER, DEGRADED_CONTENT_TYPE),)


@dataclass
class HandOffStats:
    submitted: int = 0
    refused: int = 0
    delivered: int = 0
    failed_rounds: int = 0
    broker_up: bool = True
    last_error: str = ""
    refusals_by_reason: dict[str, int] = field(default_factory=dict)


class HandOff:
    """Owns the outbox file, the producer and the drainer task of one process."""

    def __init__(self, settings: HandOffSettings) -> None:
        self.settings = settings
        self.stats = HandOffStats()
        self._outbox: Outbox | None = None
        # One thread for every SQLite call: the connection is used by one thread at a time and
        # calls stay in submission order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox")
        self._producer = AsyncProducer(
            settings.bootstrap, settings.delivery_timeout_s, settings.client_id, extra=settings.kafka_security
        )
        # (key, value, trace headers, future) of submits waiting for the next outbox commit.
        self._pending: list[tuple[bytes | None, bytes, list[tuple[str, bytes]], asyncio.Future[int]]] = []
        # Row id -> trace headers of rows not delivered yet (bounded by the outbox's rows).
        self._trace_headers: dict[int, list[tuple[str, bytes]]] = {}
        self._flusher: asyncio.Task | None = None
        self._drainer: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._topic_ready = False
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        self._outbox = await loop.run_in_executor(
            self._executor, lambda: Outbox(s.outbox_path, s.max_rows, s.max_bytes, s.synchronous)
        )
        depth = self._outbox.depth()
        if depth.rows:
            log.info("outbox %s holds %d degraded requests from before; draining", s.outbox_path, depth.rows)
        await self._producer.start()
        self._drainer = asyncio.create_task(self._drain_forever(), name="outbox-drainer")
        self._wake.set()

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stops accepting, gives the drainer up to `drain_timeout_s` to empty the outbox, closes.

        Rows still there stay in the file and are drained by the next start. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._drainer is not None and self._outbox is not None:
            self._wake.set()
            await self.wait_drained(drain_timeout_s)
            await stop_task(self._drainer)
        await self._producer.stop(flush_timeout_s=1.0)
        if self._outbox is not None:
            outbox = self._outbox
            await asyncio.get_running_loop().run_in_executor(self._executor, outbox.close)
        self._executor.shutdown(wait=True)

    # -- submitting -----------------------------------------------------------------------

    def depth(self) -> OutboxDepth:
        return self._outbox.depth() if self._outbox is not None else OutboxDepth(0, 0)

    async def submit(self, key: bytes | None, value: bytes) -> int:
        """Commits one record to the outbox; returns its row id.

        Raises OutboxFull when the outbox (or the queue of submits waiting for it) is full, and
        OutboxError when it is closed or the disk fails: the hand-off did not happen.
        """
        if self._closed or self._outbox is None:
            self._refuse("closed")
            raise OutboxError("the hand-off is closed")
        if len(self._pending) >= self.settings.max_pending:
            self._refuse("pending")
            raise OutboxFull(f"{len(self._pending)} hand-offs already wait for the outbox")
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append((key, value, tracing.context_headers(), future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="outbox-commit")
        # Shielded: a caller that goes away must not break the batch it is part of.
        row_id = await asyncio.shield(future)
        self.stats.submitted += 1
        return row_id

    def _refuse(self, reason: str) -> None:
        self.stats.refused += 1
        self.stats.refusals_by_reason[reason] = self.stats.refusals_by_reason.get(reason, 0) + 1

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                ids = await loop.run_in_executor(
                    self._executor, self._outbox.append, [(k, v) for k, v, _h, _f in batch]
                )
            except Exception as exc:  # noqa: BLE001 - every waiter learns it failed
                error = exc if isinstance(exc, OutboxError) else OutboxError(f"outbox write failed: {exc!r}")
                for _k, _v, _h, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_k, _v, trace_headers, future), row_id in zip(batch, ids):
                if row_id is not None and trace_headers:
                    self._trace_headers[row_id] = trace_headers
                if future.done():
                    continue
                if row_id is None:
                    self._refuse("full")
                    future.set_exception(OutboxFull(self._outbox.full_message()))
                else:
                    future.set_result(row_id)
            self._wake.set()

    # -- draining -------------------------------------------------------------------------

    async def wait_drained(self, timeout_s: float) -> bool:
        """Waits until the outbox is empty (True) or the timeout passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.depth().rows or self._pending:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _drain_forever(self) -> None:
        backoff = self.settings.backoff_initial_s
        while True:
            # Not asyncio.wait_for: on 3.11 it swallows a cancellation that lands as the event
            # fires, and stop() sets the event right before cancelling.
            try:
                async with asyncio.timeout(backoff if not self.stats.broker_up else 5.0):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                ok = await self._drain_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the drainer must outlive any one failure
                log.exception("outbox drainer failed; retrying")
                ok, self.stats.last_error = False, repr(exc)
            if ok:
                if not self.stats.broker_up:
                    log.info("Kafka reachable again: outbox drained")
                self.stats.broker_up = True
                backoff = self.settings.backoff_initial_s
            else:
                if self.stats.broker_up:
                    log.warning(
                        "Kafka unreachable (%s): degraded requests wait in outbox %s",
                        self.stats.last_error,
                        self.settings.outbox_path,
                    )
                self.stats.broker_up = False
                self.stats.failed_rounds += 1
                await asyncio.sleep(backoff)
                backoff = min(self.settings.backoff_max_s, backoff * 2)
                self._wake.set()

    async def _drain_once(self) -> bool:
        """Produces rows oldest first until the outbox is empty (True) or a delivery fails (False)."""
        loop = asyncio.get_running_loop()
        s = self.settings
        while True:
            items = await loop.run_in_executor(self._executor, self._outbox.peek, s.drain_batch)
            if not items:
                return True
            if await self._producer.renew_if_stale():
                self._topic_ready = False  # the broker that answers now may be a fresh one
            if not self._topic_ready:
                # Auto-created topics get the broker's default partitioning; make it ours first.
                try:
                    await asyncio.to_thread(
                        ensure_topics,
                        s.bootstrap,
                        [s.topic],
                        s.topic_partitions,
                        s.topic_replication,
                        s.delivery_timeout_s,
                        s.kafka_security,
                    )
                    self._topic_ready = True
                except Exception as exc:  # noqa: BLE001 - broker away: try again later
                    self.stats.last_error = f"cannot create topic {s.topic}: {exc!r}"
                    return False
            futures = [
                self._producer.send_nowait(
                    s.topic, item.value, item.key, [*s.headers, *self._trace_headers.get(item.id, ())]
                )
                for item in items
            ]
            try:
                # librdkafka fails each record after message.timeout.ms; the margin covers the report.
                async with asyncio.timeout(s.delivery_timeout_s + 5.0):
                    await asyncio.wait(futures)
            except TimeoutError:
                pass
            results = [
                f.result()
                if f.done() and not f.cancelled() and f.exception() is None
                else (f.exception() if f.done() and not f.cancelled() else DeliveryFailed("no delivery report"))
                for f in futures
            ]
            delivered = [item.id for item, result in zip(items, results) if isinstance(result, Delivered)]
            if delivered:
                await loop.run_in_executor(self._executor, self._outbox.delete, delivered)
                for row_id in delivered:
                    self._trace_headers.pop(row_id, None)
                self.stats.delivered += len(delivered)
            failures = [r for r in results if not isinstance(r, Delivered)]
            if failures:
                first = failures[0]
                self.stats.last_error = str(first) if isinstance(first, DeliveryFailed) else repr(first)
                # The broker may have forgotten this producer (restart): start a fresh one, and
                # re-check the topic, which a memory-backed broker also forgets.
                self._topic_ready = False
                await self._producer.reset()
                return False
