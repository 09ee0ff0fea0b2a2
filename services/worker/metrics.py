"""The worker's metrics: requests by outcome, latency, tokens, its load and GPU temperature."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from services.common.telemetry import Telemetry
from services.worker.engine import EngineStats, Stepping

if TYPE_CHECKING:
    from services.worker.relay import RelayCounts


class WorkerMetrics:
    def __init__(self, telemetry: Telemetry, stats: Callable[[], EngineStats], in_flight: Callable[[], int]) -> None:
        meter = telemetry.meter
        self.requests = meter.create_counter("ballast_worker_requests", description="Generate calls by outcome.")
        self.tokens = meter.create_counter("ballast_worker_generated_tokens", description="Tokens generated.")
        self.prefill_tokens = meter.create_counter(
            "ballast_worker_prefill_tokens", description="Prompt tokens computed by prefill."
        )
        self.ttft = telemetry.latency_histogram("ballast_worker_ttft", "Time from request to first token.")
        self.e2e = telemetry.latency_histogram("ballast_worker_e2e", "Time from request to last token.")
        self._stats = stats
        self._in_flight = in_flight
        self._meter = meter
        meter.create_observable_gauge(
            "ballast_worker_in_flight",
            callbacks=[self._observe_in_flight],
            description="Requests admitted and not finished.",
        )
        meter.create_observable_gauge(
            "ballast_worker_queued",
            callbacks=[self._observe_queued],
            description="Requests waiting for an engine slot.",
        )
        meter.create_observable_gauge(
            "ballast_worker_kv_used_ratio",
            callbacks=[self._observe_kv],
            description="Share of the KV-cache capacity in use.",
        )
        meter.create_observable_gauge(
            "ballast_worker_kv_fragmentation_ratio",
            callbacks=[self._observe_fragmentation],
            description="KV slots allocated but holding no token, over slots allocated (vLLM's "
            "paged KV; absent where the engine does not allocate in blocks).",
        )

    def observe_relay(self, counts: "RelayCounts") -> None:
        """Exports what the worker's Relay streams sent: messages, and events in them."""

        def messages(_options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(counts.messages)

        def events(_options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(counts.events)

        self._meter.create_observable_counter(
            "ballast_worker_relay_messages",
            callbacks=[messages],
            description="Messages sent on Relay streams (each carries the events of several requests).",
        )
        self._meter.create_observable_counter(
            "ballast_worker_relay_events",
            callbacks=[events],
            description="Request events (tokens, ends, accepts, errors) sent on Relay streams.",
        )

    def observe_engine_steps(self, engine: Stepping) -> None:
        """Exports the steps the engine computed (what Relay streams report as its progress)."""

        def steps(_options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(engine.steps)

        self._meter.create_observable_counter(
            "ballast_worker_engine_steps",
            callbacks=[steps],
            description="Steps the engine computed (prefill chunks and decode steps): flat while requests "
            "are in flight means a wedged engine.",
        )

    def observe_temperature(self, read: Callable[[], float | None]) -> None:
        """Exports the GPU temperature the worker reports to the balancer (none when unknown)."""

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            celsius = read()
            if celsius is not None:
                yield Observation(celsius)

        self._meter.create_observable_gauge(
            "ballast_worker_temperature",
            callbacks=[observe],
            unit="Cel",
            description="GPU temperature in degrees Celsius (NVML, or the configured override file).",
        )

    def _observe_in_flight(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self._in_flight())

    def _observe_queued(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self._stats().waiting)

    def _observe_kv(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self._stats().kv_used)

    def _observe_fragmentation(self, _options: CallbackOptions) -> Iterable[Observation]:
        fragmentation = self._stats().extra.get("kv_fragmentation")
        if fragmentation is not None:
            yield Observation(fragmentation)
