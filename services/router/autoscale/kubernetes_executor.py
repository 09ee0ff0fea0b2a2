"""The Kubernetes executor: a pool's Deployment sized through its scale subresource.

Each tick reads the Deployment's scale (`GET .../deployments/<name>/scale`): replicas asked for
but not registered in etcd yet are pods still starting, counted as capacity on its way. Roles
move through etcd as in every executor; then, when the pool needs a different number of pods
(serving plus warm standby), one merge PATCH `{"spec": {"replicas": N}}` sets it. New pods
start serving; the next tick demotes any the decision wants warm. Kubernetes picks which
pod goes on a scale-in, so the next tick rebalances roles if it took a standby.

Use either this executor or an HPA/KEDA on `ballast_desired_replicas`, not both. Needs the
`kubernetes` extra; the API calls run in a thread (the client is synchronous).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Mapping

from services.common.config import ConfigError, EtcdConfig
from services.common.etcd_session import EtcdSession
from services.common.membership import WorkerRecord
from services.router.autoscale.decision import ScaleDecision
from services.router.autoscale.executor import PoolMembers, RoleExecutor, RolePlan
from services.router.autoscale.settings import AutoscalerKubernetesConfig

log = logging.getLogger(__name__)


def load_apps_api(settings: AutoscalerKubernetesConfig) -> Any:
    """An AppsV1Api from the pod's service account (or the local kubeconfig)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ConfigError(
            "config field 'autoscaler.executor': 'kubernetes' needs the kubernetes package "
            "(pip install 'ballast[kubernetes]')"
        ) from None
    if settings.in_cluster:
        config.load_incluster_config()
    else:
        config.load_kube_config()
    return client.AppsV1Api()


class KubernetesExecutor(RoleExecutor):
    kind = "kubernetes"

    def __init__(
        self,
        etcd: EtcdConfig,
        settings: AutoscalerKubernetesConfig,
        pools: list[str],
        api: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        session: EtcdSession | None = None,
    ) -> None:
        super().__init__(etcd, clock, session)
        missing = [pool for pool in pools if pool not in settings.deployments]
        if missing:
            raise ConfigError(
                f"config field 'autoscaler.kubernetes.deployments.{missing[0]}': no Deployment named for this pool"
            )
        self.settings = settings
        self.api = api if api is not None else load_apps_api(settings)
        self.spec_replicas: dict[str, int] = {}
        """The pool's Deployment size, as last read or set."""

    def _deployment(self, pool: str) -> str:
        return self.settings.deployments[pool]

    def read_replicas(self, pool: str) -> int:
        scale = self.api.read_namespaced_deployment_scale(
            self._deployment(pool), self.settings.namespace, _request_timeout=self.settings.timeout_s
        )
        return int(scale.spec.replicas or 0)

    def set_replicas(self, pool: str, replicas: int) -> int:
        scale = self.api.patch_namespaced_deployment_scale(
            self._deployment(pool),
            self.settings.namespace,
            {"spec": {"replicas": replicas}},
            _request_timeout=self.settings.timeout_s,
        )
        return int(scale.spec.replicas or 0)

    async def members(self, pool: str, workers: Mapping[str, WorkerRecord]) -> PoolMembers:
        members = self.registered(pool, workers)
        replicas = await asyncio.to_thread(self.read_replicas, pool)
        self.spec_replicas[pool] = replicas
        registered = len(members.serving) + len(members.standby)
        members.starting_serving = max(0, replicas - registered)
        return members

    async def apply(self, decision: ScaleDecision, members: PoolMembers) -> RolePlan:
        plan = await super().apply(decision, members)
        if self.spec_replicas.get(decision.pool) != decision.total:
            replicas = await asyncio.to_thread(self.set_replicas, decision.pool, decision.total)
            log.info(
                "pool %s: Deployment %s/%s scaled to %d (%s)",
                decision.pool,
                self.settings.namespace,
                self._deployment(decision.pool),
                replicas,
                decision.reason,
            )
            self.spec_replicas[decision.pool] = replicas
        return plan
