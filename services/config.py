"""The root of Ballast's typed configuration: every section of ballast.yaml, assembled.

The shared sections and the loader live in `services.common.config`; each service's own
sections live with the service. Importing this module loads only those section classes
(pydantic models), never a service's runtime: a worker or the cache loads its config
without Kafka, the outbox or the router's machinery.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from services.backfill.settings import BackfillSettings
from services.cache.settings import CacheConfig
from services.common.config import (
    AuthConfig,
    EtcdConfig,
    KafkaConfig,
    RedisConfig,
    Section,
    TelemetryConfig,
    load_sections,
)
from services.common.event_loop import RuntimeConfig
from services.common.tls.settings import TLSConfig
from services.worker.settings import WorkerConfig
from services.router.autoscale.settings import AutoscalerSection
from services.router.degrade.config import DegradeConfig
from services.router.settings import RouterConfig


class BallastConfig(Section):
    """Every section of ballast.yaml; each service reads the ones it needs."""

    etcd: EtcdConfig = Field(default_factory=EtcdConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    tls: TLSConfig = Field(default_factory=TLSConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    backfill: BackfillSettings = Field(default_factory=BackfillSettings)
    degrade: DegradeConfig = Field(default_factory=DegradeConfig)
    autoscaler: AutoscalerSection = Field(default_factory=AutoscalerSection)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None) -> BallastConfig:
    """Reads the YAML file (if any), applies env overrides, validates everything."""
    return load_sections(BallastConfig, path, environ)
