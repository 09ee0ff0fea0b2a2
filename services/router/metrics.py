"""The router's metrics: requests by tier and outcome, latency, tokens relayed, in-flight."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from opentelemetry.metrics import CallbackOptions, Observation

from services.common.telemetry import Telemetry

BREAKER_STATE_VALUE = {"closed": 0, "half_open": 1, "open": 2}


class RouterMetrics:
    def __init__(self, telemetry: Telemetry) -> None:
        meter = telemetry.meter
        self.requests = meter.create_counter(
            "ballast_router_requests", description="Generate calls by tier and outcome."
        )
        self.tokens = meter.create_counter(
            "ballast_router_streamed_tokens", description="Tokens relayed to clients."
        )
        self.in_flight = meter.create_up_down_counter(
            "ballast_router_in_flight", description="Streams open to clients."
        )
        self.worker_attempts = meter.create_counter(
            "ballast_router_worker_retries",
            description="Requests moved to another worker after a failure, by reason.",
        )
        self.resumes = meter.create_counter(
            "ballast_router_resumes",
            description="Streams resumed mid-way on another worker, by tier and reason.",
        )
        self.breaker_transitions = meter.create_counter(
            "ballast_breaker_transitions", description="Circuit-breaker state changes, by new state."
        )
        self._meter = meter
        self.ttft = telemetry.latency_histogram(
            "ballast_router_ttft", "Time from request to first token, by tier."
        )
        self.e2e = telemetry.latency_histogram(
            "ballast_router_e2e", "Time from request to the finished event, by tier."
        )

    def observe_breakers(self, snapshot: Callable[[], Mapping[str, object]]) -> None:
        """Exports each worker's breaker state: 0 closed, 1 half-open, 2 open."""

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            for worker_id, snap in snapshot().items():
                yield Observation(BREAKER_STATE_VALUE.get(snap.state.value, 0), {"worker": worker_id})

        self._meter.create_observable_gauge(
            "ballast_breaker_state", callbacks=[observe],
            description="Circuit-breaker state per worker: 0 closed, 1 half-open, 2 open.",
        )
