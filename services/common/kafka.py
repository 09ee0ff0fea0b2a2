"""An asyncio face on confluent-kafka's producer: idempotent, acks=all, delivery reports as futures.

librdkafka's calls block, so they never run on the event loop: `produce()` only enqueues, a
dedicated thread polls for delivery reports and resolves the awaiting futures.

An idempotent producer is stuck when the broker forgets its producer id (a Tansu restart does
exactly that): its records wait out `message.timeout.ms` and fail. Two things replace it with a
fresh producer, new id: a caller `reset()`s it after any failed delivery, and a producer that
lost every broker connection (librdkafka's "all brokers down") is replaced before its next
record, so the first records after a broker comes back do not hang. Duplicates that a reset can
cause are absorbed downstream (the backfill keys everything by ticket); ordering within a key
holds because a caller never sends past a failure.

Records carry the W3C trace context of the span that sends them (`traceparent` header) unless
the caller passes one of its own, as the outbox drainer does for requests degraded earlier.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from confluent_kafka import KafkaError, KafkaException, Producer

from services.common import tracing

log = logging.getLogger(__name__)

Headers = Sequence[tuple[str, bytes]]


class DeliveryFailed(Exception):
    """The broker did not acknowledge a record (unreachable, timed out, or the producer broke)."""


@dataclass(frozen=True)
class Delivered:
    topic: str
    partition: int
    offset: int


def producer_config(bootstrap: str, delivery_timeout_s: float, client_id: str, extra: dict | None = None) -> dict:
    config = {
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        # Exactly one copy per send and in order per partition, as long as the producer lives.
        "enable.idempotence": True,
        "acks": "all",
        "max.in.flight.requests.per.connection": 5,
        "linger.ms": 5,
        # Bounds how long a record may wait for the broker before its delivery fails.
        "message.timeout.ms": max(1000, int(delivery_timeout_s * 1000)),
        "socket.connection.setup.timeout.ms": 3000,
        "reconnect.backoff.max.ms": 2000,
        # Connection-refused lines every second while the broker is away would bury the log;
        # the owners of this producer log outages once each.
        "log_level": 2,
        "log.connection.close": False,
    }
    config.update(extra or {})
    return config


class _Generation:
    """One librdkafka producer and the futures of its records that have no report yet."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.pending: set[asyncio.Future] = set()
        # Set from librdkafka's thread when every broker connection dropped: the broker that
        # answers next may not know this producer's id.
        self.lost_brokers = False


class AsyncProducer:
    """One librdkafka producer plus the thread that serves its delivery reports."""

    def __init__(
        self, bootstrap: str, delivery_timeout_s: float = 10.0, client_id: str = "ballast", extra: dict | None = None
    ) -> None:
        self._config = producer_config(bootstrap, delivery_timeout_s, client_id, extra)
        self.delivery_timeout_s = delivery_timeout_s
        self._current: _Generation | None = None
        self._lock = threading.Lock()
        self._renewing: asyncio.Lock | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.resets = 0

    def _new_generation(self) -> _Generation:
        generation: _Generation

        def on_error(err: KafkaError) -> None:
            # Runs on the poll thread; a transient connect failure is not worth a reset, losing
            # every broker (or a fatal idempotence error) is.
            if err.code() == KafkaError._ALL_BROKERS_DOWN or err.fatal():
                generation.lost_brokers = True

        generation = _Generation(Producer({**self._config, "error_cb": on_error}))
        return generation

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._renewing = asyncio.Lock()
        self._current = self._new_generation()
        self._thread = threading.Thread(target=self._poll_forever, name="kafka-producer-poll", daemon=True)
        self._thread.start()

    def _poll_forever(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                current = self._current
            if current is None:
                self._stopping.wait(0.1)
                continue
            try:
                current.producer.poll(0.1)
            except Exception as exc:  # a fatal producer raises from poll: the next reset replaces it
                log.debug("producer poll failed: %r", exc)
                self._stopping.wait(0.1)

    def _resolver(self, generation: _Generation, future: asyncio.Future):
        loop = self._loop

        def settle(err: KafkaError | None, msg) -> None:
            # Runs on the poll thread; must never raise into librdkafka.
            try:
                if err is not None:
                    outcome: object = DeliveryFailed(f"{err.name()}: {err.str()}")
                else:
                    outcome = Delivered(msg.topic(), msg.partition(), msg.offset())
            except BaseException as exc:  # noqa: BLE001 - a broken error object is still a failure
                outcome = DeliveryFailed(f"delivery report unreadable: {exc!r}")
            loop.call_soon_threadsafe(_settle_future, future, outcome, generation.pending)

        return settle

    @property
    def lost_brokers(self) -> bool:
        """True when the current producer lost every broker since it was made."""
        current = self._current
        return current is not None and current.lost_brokers

    async def renew_if_stale(self) -> bool:
        """Replaces the producer if it lost every broker; True when it did. Callers that keep
        state about the broker (a topic they created) re-check it then: the broker that comes
        back may be a fresh one."""
        assert self._renewing is not None, "start() first"
        if not self.lost_brokers:
            return False
        async with self._renewing:
            # Another caller may have renewed it while this one waited.
            if not self.lost_brokers:
                return False
            log.info("Kafka producer lost every broker; starting a fresh one (new producer id)")
            await self.reset()
            return True

    def send_nowait(
        self, topic: str, value: bytes, key: bytes | None = None, headers: Headers | None = None
    ) -> asyncio.Future:
        """Enqueues one record; the future resolves to Delivered or fails with DeliveryFailed."""
        assert self._loop is not None, "start() first"
        future = self._loop.create_future()
        with self._lock:
            current = self._current
        if current is None:
            future.set_exception(DeliveryFailed("producer is stopped"))
            return future
        headers = list(headers or ())
        if not any(name == tracing.TRACEPARENT for name, _value in headers):
            headers.extend(tracing.context_headers())
        try:
            current.producer.produce(
                topic, value=value, key=key, headers=headers, on_delivery=self._resolver(current, future)
            )
            current.pending.add(future)
        except BufferError:
            future.set_exception(DeliveryFailed("producer queue is full"))
        except (KafkaException, SystemError, RuntimeError) as exc:
            future.set_exception(DeliveryFailed(f"produce refused: {exc!r}"))
        return future

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, headers: Headers | None = None
    ) -> Delivered:
        """Produces one record and waits for the broker's acknowledgement (all replicas)."""
        await self.renew_if_stale()
        future = self.send_nowait(topic, value, key, headers)
        # librdkafka fails the record after message.timeout.ms; the margin covers the report's trip.
        async with asyncio.timeout(self.delivery_timeout_s + 5.0):
            return await future

    async def reset(self) -> None:
        """Replaces the producer after a failure: pending records fail, a new producer id starts.
        The new producer takes over at once, so sends during the reset go to it (none fails
        for want of a producer), and resets that overlap each discard only the producer they
        replaced (none is left unpolled with records waiting in it)."""
        with self._lock:
            old = self._current
            self._current = None if self._stopping.is_set() else self._new_generation()
            self.resets += 1
        if old is not None:
            await asyncio.to_thread(_discard, old.producer)
            _fail_unreported(old, "the producer was replaced before the broker answered")

    async def stop(self, flush_timeout_s: float = 5.0) -> None:
        """Flushes what it can, then stops. Idempotent."""
        with self._lock:
            current, self._current = self._current, None
        if current is not None:
            try:
                await asyncio.to_thread(current.producer.flush, flush_timeout_s)
            except Exception as exc:  # noqa: BLE001 - stopping anyway
                log.debug("producer flush on stop failed: %r", exc)
            await asyncio.to_thread(_discard, current.producer)
            _fail_unreported(current, "the producer stopped before the broker answered")
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 2.0)
            self._thread = None


def _settle_future(future: asyncio.Future, outcome: object, pending: set[asyncio.Future]) -> None:
    pending.discard(future)
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _fail_unreported(generation: _Generation, why: str) -> None:
    """Fails the futures whose reports a discarded producer never served: without this they
    would wait out the send timeout, holding their callers for nothing."""
    for future in list(generation.pending):
        if not future.done():
            future.set_exception(DeliveryFailed(why))
    generation.pending.clear()


def _discard(producer: Producer, serve_s: float = 1.0) -> None:
    """Fails a producer's queued records and lets it go. The purge's delivery reports are
    served (a bounded flush) so their futures resolve with the purge error."""
    try:
        producer.purge()
        producer.flush(serve_s)
    except Exception as exc:  # noqa: BLE001 - a fatal producer may refuse; it is dropped anyway
        log.debug("discarding producer: %r", exc)


def ensure_topics(
    bootstrap: str,
    names: Iterable[str],
    partitions: int = 1,
    replication: int = 1,
    timeout_s: float = 10.0,
    security: Mapping[str, str] | None = None,
) -> None:
    """Creates the topics that do not exist yet (blocking: run it in a thread). `security`:
    SASL and TLS properties (KafkaConfig.security_properties())."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(
        {"bootstrap.servers": bootstrap, "log_level": 2, "socket.connection.setup.timeout.ms": 3000, **(security or {})}
    )
    topics = [NewTopic(n, num_partitions=partitions, replication_factor=replication) for n in names]
    if not topics:
        return
    futures = admin.create_topics(topics, operation_timeout=timeout_s, request_timeout=timeout_s)
    for _name, future in futures.items():
        try:
            future.result(timeout=timeout_s)
        except KafkaException as exc:
            if exc.args and exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue
            raise
