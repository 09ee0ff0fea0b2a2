"""The degradation ladder: which rung answers a request that the rung above could not serve.

A logical model's path lists the rungs below its primary pool, e.g. `qwen3-27b` →
`["qwen1.5-7b", "rules"]`: first the light-model pool (a logical model of its own, served by
workers with `pool: light`), then the rule engine. `decide()` is a pure function of the error,
the request and where on the ladder it failed, so it is unit-testable without a network.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import grpc

from services.common.degraded.codec import Level
from services.common.errors import Fault
from services.common.faults import classify

# The rung name of the rule engine in a path; every other name is a light model.
RULES = "rules"


class Reason(str, enum.Enum):
    """Why a request left the rung it was on; also the `reason` label of fallback metrics."""

    ADMISSION = "admission"  # the scheduler refused it (ResourceExhausted)
    NO_WORKER = "no_worker"  # the pool has no routable worker
    RETRY_BUDGET = "retry_budget"  # retries were refused (RetryBudgetExhausted)
    WORKER_FAILED = "worker_failed"  # workers failed and the attempts are used up
    DEADLINE = "deadline"  # the deadline cannot be met on this rung


ALL_REASONS = frozenset(Reason)


@dataclass(frozen=True)
class Rung:
    level: Level
    # The light pool's logical model; empty for the rule engine.
    model: str = ""

    @property
    def label(self) -> str:
        """What answered: the light model's name or "rules"."""
        return self.model or RULES


RULES_RUNG = Rung(Level.RULES)


@dataclass(frozen=True)
class Decision:
    """Go to `rung` (position `index` in the path) because of `reason`."""

    reason: Reason
    rung: Rung
    index: int


def parse_path(names: Sequence[str], where: str = "path") -> tuple[Rung, ...]:
    """Validates a path of rung names; raises ValueError naming the entry."""
    rungs: list[Rung] = []
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}[{i}] must be a non-empty model name or {RULES!r}")
        if name in seen:
            raise ValueError(f"{where}[{i}] {name!r} appears twice")
        if RULES in seen:
            raise ValueError(f"{where}[{i}] {name!r} comes after {RULES!r}, which must be last")
        seen.add(name)
        rungs.append(RULES_RUNG if name == RULES else Rung(Level.LIGHT_MODEL, name))
    return tuple(rungs)


class Ladder:
    """The configured paths: logical model → rungs below its primary pool."""

    def __init__(self, paths: Mapping[str, Sequence[str]], default_path: Sequence[str] = (RULES,)) -> None:
        self._paths = {model: parse_path(names, f"ladders.{model}") for model, names in paths.items()}
        for model, rungs in self._paths.items():
            if any(r.model == model for r in rungs):
                raise ValueError(f"ladders.{model} lists the model itself as a rung below it")
        self._default = parse_path(default_path, "default_path")

    def path(self, model: str) -> tuple[Rung, ...]:
        return self._paths.get(model, self._default)


# The failures that may degrade a request, by fault; any other UNAVAILABLE is WORKER_FAILED.
_BY_FAULT = {
    Fault.RETRY_BUDGET_EXHAUSTED: Reason.RETRY_BUDGET,
    Fault.OVERLOADED: Reason.ADMISSION,
    Fault.DEADLINE_EXCEEDED: Reason.DEADLINE,
    Fault.NO_LIVE_WORKER: Reason.NO_WORKER,
}


def degrade_reason(error: BaseException) -> Reason | None:
    """The reason an error may degrade a request, or None when it must reach the client.

    Client errors (bad input, unknown model, auth) never degrade: a smaller model or a rule
    would only hide the mistake.
    """
    failure = classify(error)
    if failure is None:
        return None
    if failure.fault in _BY_FAULT:
        return _BY_FAULT[failure.fault]
    return Reason.WORKER_FAILED if failure.code == grpc.StatusCode.UNAVAILABLE else None


def decide(
    error: BaseException,
    allow_degraded: bool,
    path: Sequence[Rung],
    after: int = -1,
    remaining_s: float = math.inf,
    light_min_remaining_s: float = 0.0,
    reasons: Iterable[Reason] = ALL_REASONS,
) -> Decision | None:
    """The next rung after `error` on rung `after` (-1: the primary pool), or None.

    A light-model rung is skipped when less than `light_min_remaining_s` of the deadline is
    left: generating there could not finish in time, while the rule engine answers at once.
    """
    if not allow_degraded:
        return None
    reason = degrade_reason(error)
    if reason is None or reason not in set(reasons):
        return None
    for index in range(after + 1, len(path)):
        rung = path[index]
        if rung.level is Level.LIGHT_MODEL and remaining_s < light_min_remaining_s:
            continue
        return Decision(reason, rung, index)
    return None
