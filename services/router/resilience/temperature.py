"""GPU temperature gate: a hot worker takes no new requests until it has cooled down.

A worker becomes hot when its published temperature reaches `limit_c` and stays hot until
it drops below `resume_below_c`. The gap between the two marks keeps a worker hovering at
the limit from flapping in and out of rotation on every heartbeat. A worker that publishes
no temperature (CPU workers, NVML unavailable) is treated as cool.
"""

from __future__ import annotations

import math
from typing import Iterable

from pydantic import Field, model_validator

from services.common.config import Section


class TemperatureConfig(Section):
    limit_c: float = Field(78.0, description="GPU temperature (C) at which a worker stops taking new requests.")
    resume_below_c: float = Field(
        75.0, description="Temperature (C) a hot worker must drop below to take requests again."
    )

    @model_validator(mode="after")
    def _ordered(self) -> "TemperatureConfig":
        if not self.resume_below_c < self.limit_c:
            raise ValueError("resume_below_c must be below limit_c")
        return self


class TemperatureGate:
    """Hot/cool state per worker id, updated from each membership record."""

    def __init__(self, config: TemperatureConfig) -> None:
        self.config = config
        self._hot: set[str] = set()

    def observe(self, worker_id: str, temperature_c: float | None) -> bool:
        """Feeds one published reading; returns whether the worker is hot now."""
        if temperature_c is None or not math.isfinite(temperature_c):
            # No (usable) reading: nothing says the worker is hot, so it serves.
            self._hot.discard(worker_id)
            return False
        if temperature_c >= self.config.limit_c:
            self._hot.add(worker_id)
        elif temperature_c < self.config.resume_below_c:
            self._hot.discard(worker_id)
        return worker_id in self._hot

    def is_hot(self, worker_id: str) -> bool:
        return worker_id in self._hot

    def hot_workers(self) -> frozenset[str]:
        return frozenset(self._hot)

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Forgets workers that left the membership."""
        self._hot.intersection_update(worker_ids)
