"""Metrics of context fitting: truncations and dropped turns by policy, and the retention rate
measured on an evaluation set (business health: does the model still see what it needs?)."""

from __future__ import annotations

import threading
from typing import Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from services.router.context.window import ContextFit


class ContextMetrics:
    def __init__(self, meter: Meter) -> None:
        self.truncations = meter.create_counter(
            "ballast_context_truncations",
            description="Conversations cut to fit the model's context or max_turns, by policy.",
        )
        self.dropped_turns = meter.create_counter(
            "ballast_context_dropped_turns",
            description="Messages left out of conversations to make them fit, by policy.",
        )
        self._retention: dict[str, float] = {}
        self._lock = threading.Lock()
        meter.create_observable_gauge(
            "ballast_context_retention_rate",
            callbacks=[self._observe_retention],
            description="Share of evaluation conversations whose needed turn survived truncation, by policy.",
        )

    def record(self, fit: ContextFit, model: str = "") -> None:
        if not fit.truncated:
            return
        labels = {"policy": fit.policy.value, "model": model}
        self.truncations.add(1, labels)
        self.dropped_turns.add(len(fit.dropped), labels)

    def set_retention_rate(self, policy: str, rate: float) -> None:
        """Publishes the latest `retention_rate` result for `policy`."""
        with self._lock:
            self._retention[policy] = rate

    def _observe_retention(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            snapshot = dict(self._retention)
        for policy, rate in snapshot.items():
            yield Observation(rate, {"policy": policy})
