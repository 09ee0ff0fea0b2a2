"""Typed settings of the backfill service (the `backfill` section of ballast.yaml).

`BackfillSettings` is a superset of the `backfill` section's host and port. Until the shared
config adopts it, `resolve_settings()` builds it from whatever section the config holds, with
defaults for the rest; tests pass one explicitly.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from services.common.config import Section
from services.common.degraded.topics import BACKFILLED_TOPIC, DEADLETTER_TOPIC, DEGRADED_TOPIC


class BackfillSettings(Section):
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(50071, ge=0, le=65535, description="Port; 0 picks one.")
    # Kafka.
    topic: str = Field(DEGRADED_TOPIC, min_length=1, description="Topic of degraded requests (consumed).")
    backfilled_topic: str = Field(
        BACKFILLED_TOPIC, min_length=1, description="Topic the better answers are published to."
    )
    deadletter_topic: str = Field(DEADLETTER_TOPIC, min_length=1, description="Topic of requests given up on.")
    topic_partitions: int = Field(3, ge=1, description="Partitions when the service creates a topic.")
    topic_replication: int = Field(1, ge=1, description="Replication factor when the service creates a topic.")
    group_id: str = Field("ballast-backfill", min_length=1, description="Kafka consumer group.")
    session_timeout_ms: int = Field(10_000, ge=1000, description="Consumer group session timeout.")
    heartbeat_interval_ms: int = Field(1000, ge=100, description="Consumer heartbeat interval.")
    max_poll_interval_ms: int = Field(
        300_000, ge=10_000, description="Longest gap between polls before the group drops us."
    )
    delivery_timeout_s: float = Field(10.0, gt=0, description="How long a published record may wait for the broker.")
    # Replay.
    router_address: str = Field("", description="Router host:port to replay through; empty: router.host:router.port.")
    router_api_key: str = Field(
        "", description="API key of the replays; empty: the auth.api_keys entry whose tenant is replay_tenant."
    )
    replay_tenant: str = Field("ballast-backfill", min_length=1, description="Tenant whose key replays use by default.")
    replay_concurrency: int = Field(
        1,
        ge=1,
        le=64,
        description="Replays at once. They run at tier B through the router, which "
        "serves live traffic first; this bounds what they queue there. "
        "Twice as many records are in hand: storing and publishing one "
        "answer overlaps other replays.",
    )
    replay_timeout_s: float = Field(120.0, gt=0, description="Deadline of one replay.")
    replay_flush_ms: int = Field(
        1000,
        ge=0,
        le=10_000,
        description="GenerateRequest.flush_interval_ms of a replay: the backfill "
        "stores whole answers, so their tokens come in a few messages, not one each.",
    )
    max_attempts: int = Field(5, ge=1, le=100, description="Failed replays of one request before it is dead-lettered.")
    retry_backoff_s: float = Field(2.0, gt=0, description="Wait after a failed replay; doubles per attempt.")
    retry_backoff_max_s: float = Field(60.0, gt=0, description="Longest wait between failed replays.")
    busy_backoff_s: float = Field(1.0, gt=0, description="Wait when the primary pool is busy or down; doubles.")
    # A retry against a down pool costs one refused call; a long wait here is pure lag after recovery.
    busy_backoff_max_s: float = Field(5.0, gt=0, description="Longest wait for a busy or down primary pool.")
    # Storage and delivery.
    redis_prefix: str = Field("ballast:backfill:", min_length=1, description="Prefix of every backfill key in Redis.")
    answer_retention_s: int = Field(
        3 * 86400,
        ge=60,
        description="How long better answers (and their delivery marks) are kept after they are "
        "stored; enforced by the backfill's sweep, never by Redis memory pressure.",
    )
    retention_sweep_s: float = Field(60.0, gt=0, description="How often the backfill removes answers past retention.")
    session_index_max: int = Field(
        1000, ge=1, description="Answers remembered per session for Subscribe; oldest go first."
    )
    # Notices wake subscriptions, and all of them re-read when the notice listener reconnects;
    # this timer only bounds what an unforeseen loss could delay. Each re-read is a Redis call
    # per open subscription, so a short timer costs the most where subscriptions are many.
    subscribe_poll_s: float = Field(
        30.0, gt=0, description="Subscriptions re-check Redis this often even without a notice."
    )
    subscribe_max_s: float = Field(3600.0, gt=0, description="Longest life of one subscription stream.")
    # A subscription that dies between taking an answer and pushing it (its process killed, its
    # Redis reply lost) holds the answer this long; then the next subscription's read pushes it.
    claim_lease_s: float = Field(30.0, ge=1, description="How long a subscription holds an answer it is pushing.")
    max_subscribers: int = Field(1000, ge=1, description="Open subscriptions at most; more get RESOURCE_EXHAUSTED.")
    shutdown_grace_s: float = Field(5.0, ge=0, description="Time streams and replays get on stop.")

    @model_validator(mode="after")
    def _consistent(self) -> "BackfillSettings":
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError("heartbeat_interval_ms must be at most a third of session_timeout_ms")
        if len({self.topic, self.backfilled_topic, self.deadletter_topic}) != 3:
            raise ValueError("topic, backfilled_topic and deadletter_topic must differ")
        return self


def resolve_settings(config: Any, settings: BackfillSettings | None = None) -> BackfillSettings:
    """The service's settings: given ones, the config's section if it is already a
    BackfillSettings, or its host/port with defaults for the rest."""
    if settings is not None:
        return settings
    section = config.backfill
    if isinstance(section, BackfillSettings):
        return section
    return BackfillSettings(host=section.host, port=section.port)


class ReplayTargetError(ValueError):
    """The router to replay through, or the key to do it with, cannot be worked out."""


def replay_target(config: Any, settings: BackfillSettings) -> tuple[str, str]:
    """(router address, API key) for replays; raises ReplayTargetError naming what is missing."""
    address = settings.router_address
    if not address:
        if not config.router.port:
            raise ReplayTargetError(
                "backfill.router_address is empty and router.port is 0: set backfill.router_address"
            )
        address = f"{config.router.host}:{config.router.port}"
    key = settings.router_api_key
    if not key and config.auth.enabled:
        matches = config.auth.keys_of(settings.replay_tenant)
        if not matches:
            raise ReplayTargetError(
                f"no API key for replays: set backfill.router_api_key, or add a key of tenant "
                f"{settings.replay_tenant!r} to auth.api_keys"
            )
        key = matches[0]
    return address, key
