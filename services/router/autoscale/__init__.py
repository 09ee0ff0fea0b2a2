"""Autoscaling of worker pools: the pure decision logic (policy, signals, decision).

Leader election through etcd and the executors that carry decisions out live elsewhere; this
package only decides, from observations and an explicit clock.
"""

from services.router.autoscale.decision import (
    Action,
    Autoscaler,
    PoolAutoscaler,
    PoolSignals,
    Replicas,
    ScaleDecision,
)
from services.router.autoscale.policy import AutoscalerConfig, PolicyError, PoolPolicy, PrewarmWindow

__all__ = [
    "Action",
    "Autoscaler",
    "AutoscalerConfig",
    "PolicyError",
    "PoolAutoscaler",
    "PoolPolicy",
    "PoolSignals",
    "PrewarmWindow",
    "Replicas",
    "ScaleDecision",
]
