"""The consumer-group side of the backfill: records in, offsets committed only when handled.

confluent-kafka's consumer blocks, so every call to it runs on one dedicated thread (calls stay
ordered and the loop stays free). At most `max_in_flight` records are handled at once; records
of one key (session) are handled one after another, in order. An offset is committed only once
every record before it on its partition is handled, so a crash re-delivers, never skips.
Records fetched while the window is full wait in memory (at most another window's worth) and
start the moment a slot frees: a full window is the normal state under load, and putting
records back to fetch them again would pace intake at the broker's fetch cycle. While that
backlog is full too, the partitions are paused and polling goes on, so the group does not
drop a consumer that waits a long time for a busy pool. Rebalances (eager assignor) commit what is
done and cancel work on partitions taken away; their new owner re-handles them, which the
handler's idempotence makes harmless.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from services.common.tasks import stop_task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]


Handler = Callable[[Record], Awaitable[None]]


def consumer_config(
    bootstrap: str,
    group_id: str,
    session_timeout_ms: int,
    heartbeat_interval_ms: int,
    max_poll_interval_ms: int,
    security: Mapping[str, str] | None = None,
) -> dict:
    """librdkafka settings of the replay consumer; `security`: SASL and TLS properties."""
    return {
        **(security or {}),
        "bootstrap.servers": bootstrap,
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        # Never "latest": the broker's watermarks cannot be trusted (see STACK.md); a new group
        # starts from the oldest record and committed offsets do the rest.
        "auto.offset.reset": "earliest",
        # Eager assignment; cooperative-sticky stalls on the brokers we test against.
        "partition.assignment.strategy": "range",
        "session.timeout.ms": session_timeout_ms,
        "heartbeat.interval.ms": heartbeat_interval_ms,
        "max.poll.interval.ms": max_poll_interval_ms,
        # Notice a topic that came back (a memory-backed broker restarted) within seconds.
        "topic.metadata.refresh.interval.ms": 5000,
        "socket.connection.setup.timeout.ms": 3000,
        "reconnect.backoff.max.ms": 2000,
        "log_level": 2,
        "log.connection.close": False,
    }


class _Partition:
    """Offsets of one assigned partition: which are handled, which is safe to commit."""

    def __init__(self) -> None:
        self.outstanding: set[int] = set()
        self.next_offset: int | None = None  # one past the highest offset taken
        self.committed: int | None = None

    def committable(self) -> int | None:
        if self.outstanding:
            return min(self.outstanding)
        return self.next_offset


class ConsumerLoop:
    def __init__(
        self,
        config: dict,
        topic: str,
        handler: Handler,
        max_in_flight: int = 1,
        on_error: Callable[[str], None] | None = None,
        commit_interval_s: float = 0.5,
    ) -> None:
        """Offsets of handled records are committed at most every `commit_interval_s` (and on
        stop and revoke): a synchronous commit per record would cap intake at the broker's
        round trip. A crash re-delivers at most that much, which handling by ticket absorbs."""
        self._config = config
        self.commit_interval_s = commit_interval_s
        self._last_commit = 0.0
        self.topic = topic
        self._handler = handler
        self.max_in_flight = max_in_flight
        self._on_error = on_error
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kafka-consumer")
        self._consumer: Consumer | None = None
        self._lock = threading.Lock()
        self._partitions: dict[int, _Partition] = {}
        self._tasks: dict[tuple[int, int], asyncio.Task] = {}
        # Fetched records waiting for a slot, in fetch order (at most max_in_flight of them).
        self._backlog: collections.deque[Record] = collections.deque()
        self._key_tails: dict[bytes, asyncio.Task] = {}
        self._paused = False
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.assigned = asyncio.Event()
        self.handled = 0
        self._commit_failing = False

    # -- thread side (runs on the consumer thread, inside poll) ----------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        with self._lock:
            for tp in partitions:
                self._partitions[tp.partition] = _Partition()
        log.info("assigned %s", [tp.partition for tp in partitions])
        self._loop.call_soon_threadsafe(self.assigned.set)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        offsets = []
        with self._lock:
            for tp in partitions:
                state = self._partitions.pop(tp.partition, None)
                if state is not None:
                    offset = state.committable()
                    if offset is not None and offset != state.committed:
                        offsets.append(TopicPartition(self.topic, tp.partition, offset))
        if offsets:
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:
                log.warning("commit on revoke failed (the new owner re-handles those records): %s", exc)
        revoked = {tp.partition for tp in partitions}
        log.info("revoked %s", sorted(revoked))
        self._loop.call_soon_threadsafe(self._cancel_partitions, revoked)
        self._loop.call_soon_threadsafe(self.assigned.clear)

    # -- loop side ------------------------------------------------------------------------

    async def _call(self, fn, *args, **kwargs):
        return await self._loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

        def create() -> Consumer:
            consumer = Consumer(self._config)
            consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
            return consumer

        self._consumer = await self._call(create)
        self._task = asyncio.create_task(self._run(), name="backfill-consumer")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Lets records in hand finish for `grace_s`, commits what is done, leaves the group."""
        if self._stopping:
            return
        self._stopping = True
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=grace_s)
        for task in list(self._tasks.values()):
            await stop_task(task)
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._consumer is not None:
            await self._commit_ready()
            try:
                await self._call(self._consumer.close)  # runs on_revoke: commits the rest
            except (KafkaException, RuntimeError) as exc:
                log.warning("consumer close failed: %s", exc)
            self._consumer = None
        self._executor.shutdown(wait=True)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def _run(self) -> None:
        consumer = self._consumer
        while not self._stopping:
            try:
                await self._pause_or_resume(consumer)
                # As many records as there is room for, in one call to the consumer thread.
                room = max(1, self.max_in_flight - len(self._backlog))
                messages = await self._call(consumer.consume, room, 0.2)
                if time.monotonic() - self._last_commit >= self.commit_interval_s:
                    await self._commit_ready()
                if self._stopping:
                    continue
                rewound: set[int] = set()
                for message in messages:
                    if message.error() is None and message.partition() in rewound:
                        continue  # comes again: its partition was rewound to an earlier record
                    if not await self._accept(consumer, message):
                        rewound.add(message.partition())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive one bad poll
                log.exception("consumer loop error; continuing")
                await asyncio.sleep(1.0)

    async def _accept(self, consumer: Consumer, message) -> bool:
        """Takes one fetched record in hand; False when it was put back (the backlog is full)."""
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.debug("consumer: %s", error)
                if self._on_error is not None:
                    self._on_error(error.name())
            return True
        if len(self._backlog) >= self.max_in_flight:
            # Fetched before the pause took hold: put it back, it comes again after resume.
            await self._call(consumer.seek, TopicPartition(message.topic(), message.partition(), message.offset()))
            return False
        self._take(message)
        return True

    async def _pause_or_resume(self, consumer: Consumer) -> None:
        full = len(self._backlog) >= self.max_in_flight
        if full == self._paused:
            return
        assignment = await self._call(consumer.assignment)
        if full:
            await self._call(consumer.pause, assignment)
        else:
            await self._call(consumer.resume, assignment)
        self._paused = full

    def _take(self, message) -> None:
        partition, offset = message.partition(), message.offset()
        with self._lock:
            state = self._partitions.get(partition)
            if state is None:  # assignment changed under us: its new owner takes it
                return
            state.outstanding.add(offset)
            state.next_offset = max(state.next_offset or 0, offset + 1)
        record = Record(
            message.topic(),
            partition,
            offset,
            message.key(),
            message.value(),
            tuple((k, v or b"") for k, v in (message.headers() or ())),
        )
        self._backlog.append(record)
        self._start_waiting()

    def _start_waiting(self) -> None:
        """Starts backlog records, oldest first, while the window has room."""
        while self._backlog and len(self._tasks) < self.max_in_flight and not self._stopping:
            self._start(self._backlog.popleft())

    def _start(self, record: Record) -> None:
        partition, offset = record.partition, record.offset
        key = record.key or f"{partition}:{offset}".encode()
        previous = self._key_tails.get(key)
        task = asyncio.create_task(self._handle(record, previous), name=f"backfill-{partition}-{offset}")
        self._tasks[(partition, offset)] = task
        self._key_tails[key] = task
        task.add_done_callback(lambda t, k=key: self._finished(t, k, partition, offset))

    async def _handle(self, record: Record, previous: asyncio.Task | None) -> None:
        if previous is not None and not previous.done():
            # Same session: keep its records in order.
            await asyncio.gather(previous, return_exceptions=True)
        backoff = 1.0
        while True:
            try:
                await self._handler(record)
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a handler bug must not skip the record
                log.exception("handling %s[%d]@%d failed; retrying", record.topic, record.partition, record.offset)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    def _finished(self, task: asyncio.Task, key: bytes, partition: int, offset: int) -> None:
        self._tasks.pop((partition, offset), None)
        if self._key_tails.get(key) is task:
            del self._key_tails[key]
        if task.cancelled():
            return
        with self._lock:
            state = self._partitions.get(partition)
            if state is not None:
                state.outstanding.discard(offset)
        self.handled += 1
        self._start_waiting()

    def _cancel_partitions(self, partitions: set[int]) -> None:
        self._backlog = collections.deque(r for r in self._backlog if r.partition not in partitions)
        for (partition, _offset), task in list(self._tasks.items()):
            if partition in partitions:
                task.cancel()

    async def _commit_ready(self) -> None:
        self._last_commit = time.monotonic()
        offsets = []
        with self._lock:
            for partition, state in self._partitions.items():
                offset = state.committable()
                if offset is not None and offset != state.committed:
                    offsets.append(TopicPartition(self.topic, partition, offset))
        if not offsets or self._consumer is None:
            return
        try:
            await self._call(self._consumer.commit, offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            # Retried on every poll: say it once per outage, not five times a second.
            if not self._commit_failing:
                log.warning("offset commit failed (retrying; records may be handled again): %s", exc)
            self._commit_failing = True
            return
        self._commit_failing = False
        with self._lock:
            for tp in offsets:
                state = self._partitions.get(tp.partition)
                if state is not None:
                    state.committed = tp.offset
