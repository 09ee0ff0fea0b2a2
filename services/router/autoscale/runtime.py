"""Wiring the autoscaler into a router process: the executor it acts through, its observers on
the request path, and the controller that campaigns and decides. Nothing runs unless
`autoscaler.enabled` is set. Everything here reaches etcd through the router's session.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from services.common.etcd_session import EtcdSession
from services.common.membership import MembershipWatcher
from services.common.telemetry import Telemetry
from services.config import BallastConfig
from services.router.autoscale.controller import AutoscalerController
from services.router.autoscale.executor import RoleExecutor
from services.router.autoscale.observer import RouterObservations, pool_of_model


def router_identity(port: int) -> str:
    """Unique among live routers (host, port, pid): the leader lock and reports key on it."""
    return f"{socket.gethostname()}-{port}-{os.getpid()}"


def make_executor(config: BallastConfig, router_id: str, session: EtcdSession | None = None) -> RoleExecutor:
    kind = config.autoscaler.executor
    if kind == "local":
        from services.router.autoscale.local_executor import LocalExecutor

        return LocalExecutor(config, router_id, session=session)
    if kind == "kubernetes":
        from services.router.autoscale.kubernetes_executor import KubernetesExecutor

        return KubernetesExecutor(
            config.etcd, config.autoscaler.kubernetes, list(config.autoscaler.pools), session=session
        )
    return RoleExecutor(config.etcd, session=session)


async def start_autoscaler(
    config: BallastConfig,
    membership: MembershipWatcher,
    servicer: Any,
    telemetry: Telemetry,
    router_id: str,
    session: EtcdSession,
) -> AutoscalerController | None:
    """Observes the servicer's request path and starts the controller over `session` (the
    router's, which the router closes after stopping the controller); None when disabled."""
    if not config.autoscaler.enabled:
        return None
    observations = RouterObservations(
        config.autoscaler.policy(), lambda model: pool_of_model(membership.workers(), model)
    )
    servicer.runner.add_observer(observations)
    servicer.metrics.add_queue_wait_listener(observations.queue_wait)
    controller = AutoscalerController(
        config,
        router_id,
        membership,
        observations,
        make_executor(config, router_id, session),
        telemetry.meter,
        session=session,
    )
    await controller.start()
    return controller
