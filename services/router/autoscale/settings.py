"""The `autoscaler` section of ballast.yaml: leadership, the executor and the pools' policies."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.config import Section
from services.router.autoscale.policy import AutoscalerConfig


class AutoscalerLocalConfig(Section):
    state_dir: str = Field(".ballast/autoscale", description="Logs and config of the workers it starts.")
    start_timeout_s: float = Field(120.0, gt=0, description="A started worker not registered by then is stopped.")
    stop_grace_s: float = Field(30.0, gt=0, description="Time a stopped worker gets to drain before SIGKILL.")
    start_backoff_initial_s: float = Field(
        10.0,
        gt=0,
        description="After a worker it started exits or is stopped before registering, the pool's next "
        "start waits this long, doubling with each such failure in a row (a crash loop, or a host "
        "too busy to load a model, is not fed a new process every tick).",
    )
    start_backoff_max_s: float = Field(300.0, gt=0, description="The longest wait between failed starts.")

    @model_validator(mode="after")
    def _valid_backoff(self) -> "AutoscalerLocalConfig":
        if self.start_backoff_max_s < self.start_backoff_initial_s:
            raise ValueError("start_backoff_max_s must be at least start_backoff_initial_s")
        return self


class AutoscalerKubernetesConfig(Section):
    namespace: str = Field("ballast", min_length=1, description="Namespace of the worker Deployments.")
    deployments: dict[str, str] = Field(
        default_factory=lambda: {"primary": "ballast-worker"}, description="Pool -> its worker Deployment."
    )
    in_cluster: bool = Field(True, description="Use the pod's service account; false: the local kubeconfig.")
    timeout_s: float = Field(5.0, gt=0, description="Deadline of each Kubernetes API call.")


class AutoscalerSection(Section):
    """The autoscaler every router runs (one elected leader decides); see services/router/autoscale."""

    enabled: bool = Field(False, description="Campaign for leadership and scale the pools.")
    executor: Literal["none", "local", "kubernetes"] = Field(
        "none",
        description="Who carries decisions out: none (warm standby roles only; an HPA or KEDA "
        "follows the gauge), local processes, or the Deployments' scale subresource.",
    )
    tick_s: float = Field(2.0, gt=0, description="How often the leader decides.")
    report_interval_s: float = Field(1.0, gt=0, description="How often each router publishes its latency windows.")
    leader_ttl_s: int = Field(5, ge=2, le=60, description="Lease TTL of the leader lock: the takeover delay.")
    pools: dict[str, dict] = Field(
        default_factory=lambda: {"primary": {}},
        description="Pool -> policy overrides (PoolPolicy fields: targets, bounds, cooldowns, surge).",
    )
    prewarm: list = Field(
        default_factory=list, description="Prewarm windows, e.g. 'primary: warm 2 replicas 09:45-12:00 Europe/Berlin'."
    )
    local: AutoscalerLocalConfig = Field(default_factory=AutoscalerLocalConfig)
    kubernetes: AutoscalerKubernetesConfig = Field(default_factory=AutoscalerKubernetesConfig)

    @model_validator(mode="after")
    def _valid_policy(self) -> "AutoscalerSection":
        self.policy()  # raises ConfigError naming the field, e.g. autoscaler.pools.primary.min_replicas
        return self

    def policy(self):
        """The pools' policies and the prewarm schedule, validated."""
        return AutoscalerConfig.from_dict({"pools": self.pools, "prewarm": self.prewarm}, prefix="autoscaler")
