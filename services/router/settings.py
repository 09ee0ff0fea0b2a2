"""The `router` section of ballast.yaml: the public API's limits and timeouts, and the
resilience sections nested in it (breaker, retry budget, temperature, stall)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from services.common.config import Section
from services.common.streams import MAX_FLUSH_INTERVAL_MS
from services.router.quotas import QuotaConfig
from services.router.resilience.breaker import BreakerConfig
from services.router.resilience.quarantine import QuarantineConfig
from services.router.resilience.retry_budget import RetryBudgetConfig
from services.router.resilience.stall import StallConfig
from services.router.resilience.temperature import TemperatureConfig
from services.router.scheduling.tiers import TierPolicy
from services.router.structured.limits import RequestLimits


class RouterConfig(Section):
    models: list[str] = Field(
        default_factory=lambda: ["tiny"],
        description="Logical models this router serves; others are NOT_FOUND.",
    )
    host: str = Field("127.0.0.1", description="Bind address of the public API.")
    port: int = Field(50051, ge=0, le=65535, description="Port of the public API; 0 picks one.")
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the OpenAI-compatible HTTP front (/v1/chat/completions, /v1/completions, "
        "/v1/models); unset: off (a router opens no listener it was not asked for; "
        "`ballast up` turns it on); 0 picks one. Binds to `host`.",
    )
    http_max_body_bytes: int = Field(
        4 << 20, gt=0, description="Largest HTTP request body the front reads (bytes); larger is 413."
    )
    http_keepalive_s: float = Field(
        5.0, gt=0, description="While a stream waits for a token, an SSE comment goes out this often."
    )
    http_header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest an HTTP connection may take to send a request's headers, counted from when "
        "it opened or its last answer ended (so it also bounds an idle keep-alive connection).",
    )
    http_body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest an HTTP request's body may take to arrive; slower is 408 and the connection closes.",
    )
    http_stalled_client_s: float = Field(
        30.0,
        gt=0,
        description="A stream whose client has read nothing for this long (its socket stays full) is "
        "cancelled, freeing its worker slot.",
    )
    http_stream_buffer_bytes: int = Field(
        64 << 10,
        ge=4096,
        description="Bytes of an HTTP answer held for a client that does not read (the socket's "
        "send buffer, and as much again in the router) before the stream waits for it.",
    )
    default_max_tokens: int = Field(128, gt=0, description="max_tokens when a request sets none.")
    max_tokens_limit: int = Field(4096, gt=0, description="Largest max_tokens a request may ask.")
    max_request_bytes: int = Field(1 << 20, gt=0, description="Largest serialized request accepted (bytes).")
    max_prompt_chars: int = Field(200_000, gt=0, description="Longest prompt text accepted before tokenizing.")
    worker_connect_timeout_s: float = Field(2.0, gt=0, description="Deadline of a worker's unary calls (model info).")
    first_token_timeout_s: float = Field(
        10.0, gt=0, description="Longest wait for a worker's first token (prefill and queueing) before failing over."
    )
    default_deadline_s: float = Field(120.0, gt=0, description="Deadline applied when the client sets none.")
    unreachable_hold_s: float = Field(
        10.0,
        gt=0,
        description="After the router cannot reach a worker (refused or reset connection), how long it "
        "sends that incarnation no new work, unless etcd replaces or drops it sooner.",
    )
    shutdown_grace_s: float = Field(10.0, ge=0, description="Time streams get to finish on stop.")
    processes: int = Field(
        1,
        ge=1,
        le=64,
        description="Router processes serving the same ports (SO_REUSEPORT: the kernel spreads client "
        "connections over them), so one router uses that many cores. Each holds 1/N of every "
        "per-tenant quota, has its own outbox file and serves /metrics on telemetry.metrics_port "
        "+ its index. Needs fixed ports (router.port, router.http_port not 0).",
    )
    stream_interval_ms: int = Field(
        50,
        ge=0,
        le=MAX_FLUSH_INTERVAL_MS,
        description="Longest a worker may hold a stream's tokens after the first (always sent at once) to "
        "send them as one message, for a request that sets no flush_interval_ms: fewer "
        "messages for the same tokens, which is most of what relaying costs. 0: every token "
        "as it comes.",
    )
    breaker: BreakerConfig = Field(default_factory=BreakerConfig, description="Per-worker circuit breaker.")
    quotas: QuotaConfig = Field(default_factory=QuotaConfig, description="Requests and tokens per minute per tenant.")
    retry: RetryBudgetConfig = Field(default_factory=RetryBudgetConfig, description="Retry and resume budget.")
    temperature: TemperatureConfig = Field(
        default_factory=TemperatureConfig, description="GPU temperature limit with hysteresis."
    )
    stall: StallConfig = Field(default_factory=StallConfig, description="Per-tier silence that counts as a stall.")
    quarantine: QuarantineConfig = Field(
        default_factory=QuarantineConfig,
        description="Poison requests: how many workers one may cost, how long it is refused.",
    )
    limits: RequestLimits = Field(
        default_factory=RequestLimits,
        description="What one request may cost: messages, message size, JSON Schema bounds.",
    )
    scheduling: dict = Field(
        default_factory=dict,
        description="Tier policy overrides (budgets, queues, shares, preemption; see scheduling/tiers.py).",
    )
    tiering_rules_file: str = Field(
        "", description="Auto-tagging rules (YAML); empty: the bundled defaults. etcd's copy wins."
    )
    backfill_address: str = Field(
        "",
        description="Backfill service host:port behind Subscribe and GetBackfill; empty: backfill.host:backfill.port.",
    )
    backfill_timeout_s: float = Field(5.0, gt=0, description="Deadline of a GetBackfill call and of a backfill probe.")
    backfill_subscribe_max_s: float = Field(
        3600.0, gt=0, description="Longest a Subscribe stream lasts when the client sets no deadline."
    )

    @field_validator("scheduling")
    @classmethod
    def _valid_policy(cls, value: dict) -> dict:
        TierPolicy.from_mapping(value)  # raises ValueError naming the field
        return value

    @model_validator(mode="after")
    def _default_within_limit(self) -> "RouterConfig":
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")
        return self

    @model_validator(mode="after")
    def _shared_ports_are_fixed(self) -> "RouterConfig":
        # Processes can share a port only if they all bind the same one: "any free port" would
        # give each its own.
        if self.processes > 1 and (self.port == 0 or self.http_port == 0):
            raise ValueError("processes > 1 needs a fixed port and http_port (not 0)")
        return self
