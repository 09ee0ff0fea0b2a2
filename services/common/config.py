"""Typed configuration for every Ballast service, loaded from one YAML file plus env overrides.

One file (`ballast.yaml`) holds every section; each service reads the sections it needs.
Environment variables override any field: `BALLAST__ROUTER__PORT=50051` sets
`router.port` (double underscores separate levels). A bad value fails at start-up with a
message naming the field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.backfill.settings import BackfillSettings
from services.degrade.router_hooks import DegradeConfig
from services.router.resilience.breaker import BreakerConfig
from services.router.resilience.retry_budget import RetryBudgetConfig
from services.router.resilience.stall import StallConfig
from services.router.resilience.temperature import TemperatureConfig

ENV_PREFIX = "BALLAST__"
CONFIG_PATH_ENV = "BALLAST_CONFIG"


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EtcdConfig(Section):
    host: str = Field("127.0.0.1", description="etcd client host.")
    port: int = Field(2379, ge=1, le=65535, description="etcd client port.")
    prefix: str = Field("/ballast/", description="Root of every Ballast key.")
    timeout_s: float = Field(2.0, gt=0, description="Deadline of each etcd call.")
    lease_ttl_s: int = Field(3, ge=2, le=60, description="TTL of a worker's membership lease.")
    heartbeat_s: float = Field(1.0, gt=0, description="How often a worker refreshes its record.")
    reconnect_backoff_s: float = Field(0.5, gt=0, description="First wait before reconnecting.")

    @field_validator("prefix")
    @classmethod
    def _slash_terminated(cls, value: str) -> str:
        if not value.startswith("/") or not value.endswith("/"):
            raise ValueError("must start and end with '/'")
        return value


class RedisConfig(Section):
    url: str = Field("redis://127.0.0.1:6379/0", description="Redis (or Redis Cluster seed) URL.")
    timeout_s: float = Field(1.0, gt=0, description="Deadline of each Redis call.")


class KafkaConfig(Section):
    bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers.")
    timeout_s: float = Field(5.0, gt=0, description="Deadline of admin and produce calls.")


class AuthConfig(Section):
    enabled: bool = Field(True, description="Require an API key on public calls.")
    api_keys: dict[str, str] = Field(
        default_factory=dict, description="API key -> tenant name."
    )
    default_tenant: str = Field("local", description="Tenant of every call when auth is off.")


class TracingConfig(Section):
    endpoint: str = Field(
        "", description="OTLP/gRPC collector (host:port or http[s]://host:port); empty: no exporter, "
                        "trace context still propagates."
    )
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0,
        description="Share of new traces recorded; a call that arrives with a trace context follows its caller.",
    )
    insecure: bool = Field(True, description="Plaintext to the collector (false: TLS).")
    export_timeout_s: float = Field(10.0, gt=0, description="Deadline of each export to the collector.")

    @field_validator("endpoint")
    @classmethod
    def _host_and_port(cls, value: str) -> str:
        address = value.split("://", 1)[-1].rstrip("/")
        if value and (":" not in address or not address.rsplit(":", 1)[1].isdigit()):
            raise ValueError("must be host:port (or http[s]://host:port), or empty to export nothing")
        return value


class TelemetryConfig(Section):
    metrics_host: str = Field("127.0.0.1", description="Bind address of /metrics.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Port of /metrics; 0 picks one.")
    enabled: bool = Field(True, description="Serve Prometheus metrics.")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Distributed traces (OTLP).")


class RouterConfig(Section):
    models: list[str] = Field(
        default_factory=lambda: ["tiny"],
        description="Logical models this router serves; others are NOT_FOUND.",
    )
    host: str = Field("127.0.0.1", description="Bind address of the public API.")
    port: int = Field(50051, ge=0, le=65535, description="Port of the public API; 0 picks one.")
    default_max_tokens: int = Field(128, gt=0, description="max_tokens when a request sets none.")
    max_tokens_limit: int = Field(4096, gt=0, description="Largest max_tokens a request may ask.")
    max_request_bytes: int = Field(
        1 << 20, gt=0, description="Largest serialized request accepted (bytes)."
    )
    max_prompt_chars: int = Field(
        200_000, gt=0, description="Longest prompt text accepted before tokenizing."
    )
    worker_connect_timeout_s: float = Field(
        2.0, gt=0, description="Deadline of a worker's unary calls (model info)."
    )
    first_token_timeout_s: float = Field(
        10.0, gt=0, description="Longest wait for a worker's first token (prefill and queueing) before failing over."
    )
    default_deadline_s: float = Field(
        120.0, gt=0, description="Deadline applied when the client sets none."
    )
    unreachable_hold_s: float = Field(
        10.0, gt=0,
        description="After the router cannot reach a worker (refused or reset connection), how long it "
                    "sends that incarnation no new work, unless etcd replaces or drops it sooner.",
    )
    shutdown_grace_s: float = Field(10.0, ge=0, description="Time streams get to finish on stop.")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig, description="Per-worker circuit breaker.")
    retry: RetryBudgetConfig = Field(default_factory=RetryBudgetConfig, description="Retry and resume budget.")
    temperature: TemperatureConfig = Field(
        default_factory=TemperatureConfig, description="GPU temperature limit with hysteresis."
    )
    stall: StallConfig = Field(default_factory=StallConfig, description="Per-tier silence that counts as a stall.")
    scheduling: dict = Field(
        default_factory=dict,
        description="Tier policy overrides (budgets, queues, shares, preemption; see scheduling/tiers.py).",
    )
    tiering_rules_file: str = Field(
        "", description="Auto-tagging rules (YAML); empty: the bundled defaults. etcd's copy wins."
    )
    backfill_address: str = Field(
        "", description="Backfill service host:port behind Subscribe and GetBackfill; empty: backfill.host:backfill.port."
    )
    backfill_timeout_s: float = Field(5.0, gt=0, description="Deadline of a GetBackfill call and of a backfill probe.")
    backfill_subscribe_max_s: float = Field(
        3600.0, gt=0, description="Longest a Subscribe stream lasts when the client sets no deadline."
    )

    @field_validator("scheduling")
    @classmethod
    def _valid_policy(cls, value: dict) -> dict:
        from services.router.scheduling.tiers import TierPolicy

        TierPolicy.from_mapping(value)  # raises ValueError naming the field
        return value


    @model_validator(mode="after")
    def _default_within_limit(self) -> "RouterConfig":
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")
        return self


class WorkerConfig(Section):
    id: str = Field("", description="Worker id in etcd; empty: host-port-pid.")
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(0, ge=0, le=65535, description="Port; 0 picks one.")
    advertise_host: str = Field("", description="Address the router dials; empty: host.")
    engine: Literal["torch", "vllm"] = Field("torch", description="Model runtime.")
    model_dir: str = Field(".ballast/models/tiny", description="Hugging Face model folder.")
    model_name: str = Field("tiny", description="Logical model name clients ask for.")
    pool: str = Field("primary", description="Pool of the model: primary or light.")
    device: str = Field("auto", description="torch device: auto, cpu or cuda.")
    torch_runtime: Literal["auto", "native", "transformers"] = Field(
        "auto", description="torch engine: native batched Llama-family decoder, transformers for "
                            "any model, or auto (native where it computes the model exactly).")
    max_batch: int = Field(64, ge=1, description="torch engine: decode steps in one forward pass.")
    gil_switch_ms: float = Field(
        1.0, gt=0, le=100, description="Python's thread switch interval in the worker process: how long "
                                       "the event loop may wait for the compute thread to yield the GIL.")
    b_tier_flush_ms: float = Field(
        50.0, ge=0, le=1000, description="B-tier streams: tokens leave in one message per this many ms "
                                         "(0: every token as it comes).")
    max_concurrency: int = Field(8, ge=1, description="Sequences generated at once (capacity).")
    max_queue: int = Field(16, ge=0, description="Requests allowed to wait for a slot.")
    temperature_file: str = Field(
        "", description="File holding a GPU temperature in C, read instead of NVML (tests)."
    )
    drain_grace_s: float = Field(20.0, ge=0, description="Time in-flight streams get on SIGTERM.")
    fault_file: str = Field(
        "", description="Chaos testing: while this file says 'unavailable', Generate fails at once."
    )
    cache_address: str = Field("", description="KV-cache service host:port; empty: no KV persistence.")
    kv_block_tokens: int = Field(32, ge=1, le=4096, description="Tokens per stored KV block.")
    kv_restore_policy: Literal["adaptive", "always", "never"] = Field(
        "adaptive", description="Restore a cached prefix by measured cost, always, or never.")
    kv_memory_sessions: int = Field(
        4, ge=0, description="Recent sessions whose KV the engine keeps in memory (0: none).")
    kv_save_queue: int = Field(8, ge=1, description="Pending session saves; more are dropped.")
    kv_timeout_s: float = Field(0.5, gt=0, description="Deadline of a KV lookup or health check.")
    kv_restore_timeout_s: float = Field(5.0, gt=0, description="Longest a KV restore may take.")
    kv_save_timeout_s: float = Field(10.0, gt=0, description="Longest a KV save may take.")
    kv_ttl_s: int = Field(0, ge=0, description="TTL of saved blocks; 0: the cache's default.")
    # vLLM engine (worker.engine = vllm). Checked against the model and the GPU at start.
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="vLLM: share of the GPU's memory for weights, activations and KV.")
    kv_cache_dtype: Literal["", "auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32"] = Field(
        "", description="vLLM: KV-cache dtype, required and explicit (fp8, or the weights' dtype); "
                        "'auto' is refused.")
    max_model_len: int = Field(
        0, ge=0, description="vLLM: longest sequence served; 0: the model's own maximum.")
    enable_chunked_prefill: bool = Field(True, description="vLLM: split long prefills across steps.")
    enable_prefix_caching: bool = Field(True, description="vLLM: reuse KV of shared prompt prefixes.")
    enforce_eager: bool = Field(False, description="vLLM: no CUDA graphs (less memory, slower decode).")
    vllm_cpu_threads_bind: str = Field(
        "auto", pattern=r"^(auto|nobind|[0-9,\-|]+)$",
        description="vLLM on CPUs: cores the engine's OpenMP threads run on (VLLM_CPU_OMP_THREADS_BIND): "
                    "auto, nobind, or a list like '0-3'. Give engines sharing a host disjoint cores.")
    vllm_cpu_kv_cache_gib: int = Field(
        1, ge=1, le=1024, description="vLLM on CPUs: host memory for the KV cache in GiB, in place of "
                                      "gpu_memory_utilization (vLLM's VLLM_CPU_KVCACHE_SPACE).")
    sleep_on_standby: bool = Field(
        False, description="vLLM on GPUs: start asleep (weights offloaded, KV freed) and wake on the first "
                           "request. vLLM's CPU build has no sleep mode: a CPU standby stays loaded.")
    standby: bool = Field(
        False, description="Start as a warm standby: model loaded, registered, not routable until promoted.")
    respawn: bool = Field(
        False, description="Run under a keeper that has the engine imported and starts a fresh worker "
                           "at once when one dies (about 0.5 s instead of a cold start).")
    respawn_max: int = Field(
        10, ge=0, description="Crashes within respawn_window_s after which the keeper gives up (exit 1).")
    respawn_window_s: float = Field(60.0, gt=0, description="Window of respawn_max.")

    @field_validator("vllm_cpu_threads_bind", mode="before")
    @classmethod
    def _core_list_as_text(cls, value):
        # A single core ("0") arrives from YAML or the environment as a number.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class CacheConfig(Section):
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(50061, ge=0, le=65535, description="Port; 0 picks one.")
    key_prefix: str = Field("ballast:kv:", min_length=1, description="Prefix of every block key in Redis.")
    ttl_s: int = Field(3600, ge=1, description="TTL of a block unless Put asks less; reads refresh it.")
    max_ttl_s: int = Field(86400, ge=1, description="Longest TTL a Put may ask.")
    max_block_bytes: int = Field(16 << 20, ge=1, description="Largest block accepted (bytes).")
    max_blocks_per_call: int = Field(16384, ge=1, description="Most blocks one call may name.")
    chunk_bytes: int = Field(
        1 << 20, ge=4096, le=4 << 20, description="Largest data chunk in one Get message (bytes).")
    batch_bytes: int = Field(8 << 20, ge=1, description="Block bytes per Redis pipeline batch.")


class AutoscalerLocalConfig(Section):
    state_dir: str = Field(".ballast/autoscale", description="Logs and config of the workers it starts.")
    start_timeout_s: float = Field(120.0, gt=0, description="A started worker not registered by then is stopped.")
    stop_grace_s: float = Field(30.0, gt=0, description="Time a stopped worker gets to drain before SIGKILL.")


class AutoscalerKubernetesConfig(Section):
    namespace: str = Field("ballast", min_length=1, description="Namespace of the worker Deployments.")
    deployments: dict[str, str] = Field(
        default_factory=lambda: {"primary": "ballast-worker"}, description="Pool -> its worker Deployment.")
    in_cluster: bool = Field(True, description="Use the pod's service account; false: the local kubeconfig.")
    timeout_s: float = Field(5.0, gt=0, description="Deadline of each Kubernetes API call.")


class AutoscalerSection(Section):
    """The autoscaler every router runs (one elected leader decides); see services/router/autoscale."""

    enabled: bool = Field(False, description="Campaign for leadership and scale the pools.")
    executor: Literal["none", "local", "kubernetes"] = Field(
        "none", description="Who carries decisions out: none (warm standby roles only; an HPA or KEDA "
                            "follows the gauge), local processes, or the Deployments' scale subresource.")
    tick_s: float = Field(2.0, gt=0, description="How often the leader decides.")
    report_interval_s: float = Field(1.0, gt=0, description="How often each router publishes its latency windows.")
    leader_ttl_s: int = Field(5, ge=2, le=60, description="Lease TTL of the leader lock: the takeover delay.")
    pools: dict[str, dict] = Field(
        default_factory=lambda: {"primary": {}},
        description="Pool -> policy overrides (PoolPolicy fields: targets, bounds, cooldowns, surge).")
    prewarm: list = Field(
        default_factory=list, description="Prewarm windows, e.g. 'primary: warm 2 replicas 09:45-12:00 Europe/Berlin'.")
    local: AutoscalerLocalConfig = Field(default_factory=AutoscalerLocalConfig)
    kubernetes: AutoscalerKubernetesConfig = Field(default_factory=AutoscalerKubernetesConfig)

    @model_validator(mode="after")
    def _valid_policy(self) -> "AutoscalerSection":
        self.policy()  # raises ConfigError naming the field, e.g. autoscaler.pools.primary.min_replicas
        return self

    def policy(self):
        """The pools' policies and the prewarm schedule, validated."""
        from services.router.autoscale.policy import AutoscalerConfig

        return AutoscalerConfig.from_dict({"pools": self.pools, "prewarm": self.prewarm}, prefix="autoscaler")


class BallastConfig(Section):
    etcd: EtcdConfig = Field(default_factory=EtcdConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    backfill: BackfillSettings = Field(default_factory=BackfillSettings)
    degrade: DegradeConfig = Field(default_factory=DegradeConfig)
    autoscaler: AutoscalerSection = Field(default_factory=AutoscalerSection)


class ConfigError(Exception):
    """The configuration is invalid; the message names the field."""


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX):].split("__") if part]
        if not path:
            continue
        node = overrides
        for part in path[:-1]:
            node = node.setdefault(part, {})
        # JSON lets env values carry numbers, booleans and maps; plain strings stay strings.
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node[path[-1]] = value
    return overrides


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        lines.append(f"config field '{field}': {item['msg']}")
    return "; ".join(lines)


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None) -> BallastConfig:
    """Reads the YAML file (if any), applies env overrides, validates everything."""
    environ = dict(os.environ if environ is None else environ)
    path = path or environ.get(CONFIG_PATH_ENV) or None
    data: dict[str, Any] = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded
    data = _merge(data, _env_overrides(environ))
    try:
        return BallastConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
