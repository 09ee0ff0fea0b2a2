"""The backfill service's metrics: processed, dead-lettered, replays, lag behind the original request."""

from __future__ import annotations

import time
from typing import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from services.common.telemetry import Telemetry

# Lag can be seconds (a quiet mesh) to days (a long outage): wide, coarse buckets.
LAG_BUCKETS_S = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)


class BackfillMetrics:
    def __init__(self, telemetry: Telemetry) -> None:
        meter = telemetry.meter
        self.processed = meter.create_counter(
            "ballast_backfill_processed",
            description="Degraded requests handled, by outcome (stored, duplicate, dead_lettered).",
        )
        self.dead_lettered = meter.create_counter(
            "ballast_backfill_dead_lettered", description="Degraded requests given up on, by cause."
        )
        self.replays = meter.create_counter(
            "ballast_backfill_replays",
            description="Replays on the full model, by result (ok, busy, unhealthy, config, failed).",
        )
        self.delivered = meter.create_counter(
            "ballast_backfill_delivered", description="Better answers pushed to a subscription (once per ticket)."
        )
        self.lag = meter.create_histogram(
            "ballast_backfill_completion_lag",
            unit="s",
            description="Seconds from the original request to its better answer being stored.",
            explicit_bucket_boundaries_advisory=list(LAG_BUCKETS_S),
        )
        self.replay_latency = telemetry.latency_histogram(
            "ballast_backfill_replay_duration", "Time one successful replay took."
        )
        self._meter = meter

    def observe_current_lag(self, oldest_received_at: Callable[[], float | None]) -> None:
        """Exports the age of the oldest request in hand (0 when idle): grows while the pool is busy."""

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            oldest = oldest_received_at()
            yield Observation(0.0 if oldest is None else max(0.0, time.time() - oldest))

        self._meter.create_observable_gauge(
            "ballast_backfill_current_lag",
            callbacks=[observe],
            unit="s",
            description="Seconds since the original timestamp of the oldest degraded request being handled.",
        )

    def observe_replaying(self, count: Callable[[], int]) -> None:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(count())

        self._meter.create_observable_gauge(
            "ballast_backfill_replays_in_flight",
            callbacks=[observe],
            description="Replays running on the router now (at most backfill.replay_concurrency).",
        )

    def observe_subscribers(self, count: Callable[[], int]) -> None:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(count())

        self._meter.create_observable_gauge(
            "ballast_backfill_subscribers", callbacks=[observe], description="Open Subscribe streams."
        )
