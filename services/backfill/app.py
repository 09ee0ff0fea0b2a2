"""The backfill service process: consumes degraded requests, replays them on the full model,
stores each better answer once and serves `ballast.v1.Backfill` (Subscribe, GetAnswer).

Health is SERVING only while both Kafka and Redis answer; `ballast_dependency_up` says which
is missing. Without a usable replay target (router address and API key) the service serves
what is stored but consumes nothing: degraded requests wait safely in Kafka.

Shutdown order: NOT_SERVING → server.stop(grace) → consumer (finish or cancel replays, commit,
leave the group) → producer flush → Redis → probes → telemetry → the etcd session.

With a replay target, the membership watch (for primary pool returns) and the quarantine watch
share one etcd session, built here and closed last.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from functools import partial

import grpc
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ballast.v1 import backfill_pb2, backfill_pb2_grpc
from services.backfill.consumer import ConsumerLoop, consumer_config
from services.backfill.kafka_check import KafkaCheck, admin_client
from services.backfill.metrics import BackfillMetrics
from services.backfill.parked import ParkedTickets
from services.backfill.pool_watch import PrimaryPoolWatch
from services.backfill.processor import Processor
from services.backfill.replay import Replayer, RouterReplayer
from services.backfill.retention import RetentionSweeper
from services.backfill.servicer import BackfillServicer
from services.backfill.settings import BackfillSettings, ReplayTargetError, replay_target, resolve_settings
from services.backfill.store import AnswerStore, ClusterAnswerStore, Notices
from services.common.auth import Authenticator
from services.common.config import KafkaConfig, RedisConfig
from services.common.etcd_session import EtcdSession
from services.common.grpc_server import add_health_and_reflection, bind, bind_health_port, new_server, set_serving
from services.common.kafka import AsyncProducer, ensure_topics
from services.common.membership import MembershipWatcher
from services.common.probes import DependencyProbe
from services.common.quarantine import QuarantineStore
from services.common.quarantine_etcd import QuarantineWatch
from services.common.redis_client import AnyRedis, make_client, ping as ping_redis
from services.common.telemetry import Telemetry
from services.common.tls.credentials import server_credentials
from services.config import BallastConfig

log = logging.getLogger(__name__)

SERVICE_NAME = backfill_pb2.DESCRIPTOR.services_by_name["Backfill"].full_name
# Records handled at once, per replay slot. Besides its replay, a record reads and stores its
# answer in Redis and waits for the broker's ack of the backfilled record; with twice as many
# records in hand as replay slots, those waits overlap other records' replays instead of
# leaving the slots (and the primary pool's batches) empty. Measured on the backfill benchmark:
# about 94 replays/s with one record per slot, 106 to 123 with two.
RECORDS_IN_HAND_PER_REPLAY = 2


@dataclass
class BackfillApp:
    config: BallastConfig
    settings: BackfillSettings
    server: grpc.aio.Server
    port: int
    telemetry: Telemetry
    health: object
    redis: AnyRedis
    store: AnswerStore
    notices: Notices
    producer: AsyncProducer
    probes: list[DependencyProbe]
    servicer: BackfillServicer
    processor: Processor | None = None
    consumer: ConsumerLoop | None = None
    replayer: Replayer | None = None
    membership: MembershipWatcher | None = None
    # The routers' quarantine, followed from etcd: poison is parked, never replayed.
    quarantine_watch: QuarantineWatch | None = None
    # The process's one etcd session, under both watches (None: no replays, no etcd).
    etcd: EtcdSession | None = None
    _pubsub_redis: AnyRedis | None = None
    _topics_task: asyncio.Task | None = field(default=None, repr=False)
    sweeper: RetentionSweeper | None = None

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    async def shutdown(self, grace_s: float | None = None) -> None:
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.server.stop(grace)
        if self._topics_task is not None:
            self._topics_task.cancel()
        if self.consumer is not None:
            await self.consumer.stop(grace)
        if self.replayer is not None:
            await self.replayer.close()
        if self.membership is not None:
            await self.membership.stop()
        if self.quarantine_watch is not None:
            await self.quarantine_watch.stop()
        await self.producer.stop()
        await self.notices.stop()
        if self.sweeper is not None:
            await self.sweeper.stop()
        for probe in self.probes:
            await probe.stop()
        await self.redis.aclose()
        if self._pubsub_redis is not None:
            await self._pubsub_redis.aclose()
        self.telemetry.stop()
        if self.etcd is not None:
            await self.etcd.close()  # last: the watches above stopped, and neither closes it


def _redis_client(config: RedisConfig, timeout_s: float | None) -> AnyRedis:
    return make_client(
        config,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s or 5.0,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2),
        health_check_interval=0,
    )


async def _ensure_topics_once(kafka: KafkaConfig, settings: BackfillSettings, timeout_s: float) -> bool:
    """One attempt to create any missing topic; False while the broker is away."""
    names = [settings.topic, settings.backfilled_topic, settings.deadletter_topic]
    try:
        await asyncio.to_thread(
            ensure_topics,
            kafka.bootstrap,
            names,
            settings.topic_partitions,
            settings.topic_replication,
            timeout_s,
            kafka.security_properties(),
        )
        return True
    except Exception as exc:  # noqa: BLE001 - broker away: the callers retry
        log.debug("cannot create topics now: %r", exc)
        return False


async def _ensure_topics_until_done(kafka: KafkaConfig, settings: BackfillSettings, timeout_s: float) -> None:
    backoff = 1.0
    while not await _ensure_topics_once(kafka, settings, timeout_s):
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 10.0)


async def create_server(
    config: BallastConfig, settings: BackfillSettings | None = None, replayer: Replayer | None = None
) -> BackfillApp:
    """Starts the service; `settings` and `replayer` override the config (tests)."""
    settings = resolve_settings(config, settings)
    telemetry = Telemetry("backfill", config.telemetry)
    metrics = BackfillMetrics(telemetry)
    client = _redis_client(config.redis, config.redis.timeout_s)
    # Pub/sub blocks on reads by design: its own connection, without the command timeout.
    pubsub_client = _redis_client(config.redis, None)
    if config.redis.cluster:
        store = ClusterAnswerStore(
            client,
            settings.redis_prefix,
            settings.answer_retention_s,
            settings.session_index_max,
            settings.claim_lease_s,
            config.redis.wait_replicas,
            config.redis.wait_timeout_ms,
        )
    else:
        store = AnswerStore(
            client,
            settings.redis_prefix,
            settings.answer_retention_s,
            settings.session_index_max,
            settings.claim_lease_s,
        )
    notices = Notices(pubsub_client, store.channel)
    servicer = BackfillServicer(settings, Authenticator(config.auth), store, notices, metrics)
    metrics.observe_subscribers(lambda: servicer.subscribers)

    server = new_server(tls=config.tls)
    backfill_pb2_grpc.add_BackfillServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = bind(server, settings.host, settings.port, server_credentials(config.tls, "backfill"))
    bind_health_port(server, settings.host, config.tls)

    kafka_security = config.kafka.security_properties()
    producer = AsyncProducer(
        config.kafka.bootstrap, settings.delivery_timeout_s, "ballast-backfill", extra=kafka_security
    )
    check_kafka = KafkaCheck(
        admin_client(config.kafka.bootstrap, kafka_security),
        producer,
        config.kafka.timeout_s,
        on_renewed=partial(_ensure_topics_once, config.kafka, settings, config.kafka.timeout_s),
    )

    async def check_redis() -> None:
        await ping_redis(client)

    async def on_change(_up: bool) -> None:
        # etcd only hastens replays after an outage (pool_watch): not a reason to stop serving.
        serving = not set(telemetry.dependencies.missing()) - {"etcd"}
        await set_serving(health, [SERVICE_NAME], serving)

    probes = [
        DependencyProbe(
            "kafka",
            check_kafka,
            telemetry.dependencies,
            interval_s=2.0,
            timeout_s=config.kafka.timeout_s + 1,
            on_change=on_change,
        ),
        DependencyProbe(
            "redis",
            check_redis,
            telemetry.dependencies,
            interval_s=2.0,
            timeout_s=config.redis.timeout_s + 1,
            on_change=on_change,
        ),
    ]
    await server.start()
    telemetry.start()
    for probe in probes:
        await probe.start()
    await notices.start()
    await producer.start()
    app = BackfillApp(
        config,
        settings,
        server,
        port,
        telemetry,
        health,
        client,
        store,
        notices,
        producer,
        probes,
        servicer,
        _pubsub_redis=pubsub_client,
    )
    app.sweeper = RetentionSweeper(store, settings.retention_sweep_s)
    await app.sweeper.start()
    app._topics_task = asyncio.create_task(
        _ensure_topics_until_done(config.kafka, settings, config.kafka.timeout_s), name="backfill-topics"
    )

    if replayer is None:
        try:
            address, api_key = replay_target(config, settings)
            replayer = RouterReplayer(
                address,
                api_key,
                settings.replay_timeout_s,
                flush_interval_ms=settings.replay_flush_ms,
                tls=config.tls.towards_public_port(),
            )
            log.info("replaying through router %s", address)
        except ReplayTargetError as exc:
            log.error("backfill will not consume degraded requests: %s", exc)
    if replayer is not None:
        app.replayer = replayer
        app.etcd = EtcdSession(config.etcd)
        app.membership = MembershipWatcher(config.etcd, telemetry.dependencies, app.etcd)
        await app.membership.start()
        app.quarantine_watch = QuarantineWatch(config.etcd, QuarantineStore(), app.etcd)
        await app.quarantine_watch.start()
        app.processor = Processor(
            settings,
            store,
            replayer,
            producer,
            metrics,
            pool_watch=PrimaryPoolWatch(app.membership),
            quarantine=app.quarantine_watch.store,
            parked=ParkedTickets(client, settings.redis_prefix),
            ensure_topics=partial(_ensure_topics_once, config.kafka, settings, config.kafka.timeout_s),
        )
        metrics.observe_current_lag(app.processor.oldest_in_hand)
        metrics.observe_replaying(lambda: app.processor.replaying)
        app.consumer = ConsumerLoop(
            consumer_config(
                config.kafka.bootstrap,
                settings.group_id,
                settings.session_timeout_ms,
                settings.heartbeat_interval_ms,
                settings.max_poll_interval_ms,
                kafka_security,
            ),
            settings.topic,
            app.processor.handle,
            max_in_flight=RECORDS_IN_HAND_PER_REPLAY * settings.replay_concurrency,
        )
        await app.consumer.start()
    log.info(
        "backfill serving on %s (kafka %s, redis %s)", app.address, config.kafka.bootstrap, config.redis.display_url
    )
    return app
