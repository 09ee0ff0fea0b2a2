"""The router's metrics: requests by tier and outcome, latency, tokens relayed, in-flight."""

from __future__ import annotations

from services.common.telemetry import Telemetry


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
            description="Extra workers tried before the first token, by reason.",
        )
        self.ttft = telemetry.latency_histogram(
            "ballast_router_ttft", "Time from request to first token, by tier."
        )
        self.e2e = telemetry.latency_histogram(
            "ballast_router_e2e", "Time from request to the finished event, by tier."
        )
