"""The `degrade` section of ballast.yaml: the router side of the degradation ladder."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from services.common.config import Section
from services.common.degraded.topics import DEGRADED_TOPIC
from services.router.degrade.ladder import RULES, Ladder, Reason, parse_path
from services.router.degrade.rules import RuleEngine


class DegradeConfig(Section):
    """The `degrade` section of ballast.yaml (router side of the degradation ladder)."""

    enabled: bool = Field(True, description="Degrade requests the primary pool cannot serve; off: they get the error.")
    ladders: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Logical model -> rungs below its primary pool, in order: light models, then 'rules'.",
    )
    default_path: list[str] = Field(
        default_factory=lambda: [RULES], description="Rungs of models without a ladder ([] : never degrade)."
    )
    reasons: list[Reason] = Field(
        default_factory=lambda: list(Reason), description="Failures that degrade; others reach the client."
    )
    light_min_remaining_s: float = Field(
        1.0, ge=0, description="Skip light-model rungs when less of the deadline is left (rules answer at once)."
    )
    rules_file: str = Field("", description="Rule-engine intents (YAML); empty: the bundled default_intents.yaml.")
    rules_piece_chars: int = Field(8, ge=1, le=1024, description="Characters per streamed piece of a rules answer.")
    handoff: bool = Field(True, description="Hand degraded requests to Kafka for backfill (and give clients a ticket).")
    topic: str = Field(DEGRADED_TOPIC, min_length=1, description="Kafka topic of degraded requests.")
    topic_partitions: int = Field(3, ge=1, description="Partitions when the router creates the topic.")
    topic_replication: int = Field(1, ge=1, description="Replication factor when the router creates the topic.")
    outbox_path: str = Field(
        "outbox/degraded.sqlite",
        min_length=1,
        description="SQLite outbox (relative to the working folder); one per router replica.",
    )
    outbox_max_rows: int = Field(100_000, ge=1, description="Rows the outbox may hold; beyond, hand-offs are refused.")
    outbox_max_bytes: int = Field(
        256 << 20, ge=1024, description="Bytes the outbox may hold; beyond, hand-offs are refused."
    )
    outbox_synchronous: Literal["FULL", "NORMAL"] = Field(
        "FULL", description="SQLite synchronous mode: FULL survives power loss, NORMAL only process crashes."
    )
    delivery_timeout_s: float = Field(10.0, gt=0, description="How long a record may wait for a broker ack.")
    drain_batch: int = Field(100, ge=1, le=10_000, description="Outbox rows produced per round.")
    stop_drain_s: float = Field(
        5.0, ge=0, description="Time the outbox gets to drain on shutdown (the rest waits on disk)."
    )
    origin: str = Field("", description="This replica's name in hand-offs; empty: host-pid.")

    @field_validator("ladders")
    @classmethod
    def _valid_ladders(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        Ladder(value)  # raises ValueError naming the entry
        return value

    @field_validator("default_path")
    @classmethod
    def _valid_default(cls, value: list[str]) -> list[str]:
        parse_path(value, "default_path")
        return value

    @field_validator("rules_file")
    @classmethod
    def _valid_rules(cls, value: str) -> str:
        if value:
            RuleEngine.from_file(value)  # RulesError (a ValueError) names the line
        return value
