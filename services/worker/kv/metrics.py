"""The worker's KV-persistence metrics: where each request's prefix KV came from, lookups,
restore-or-recompute choices and their times, and the fate of every session save."""

from __future__ import annotations

from typing import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from services.common.telemetry import Telemetry


class KVMetrics:
    def __init__(self, telemetry: Telemetry) -> None:
        meter = telemetry.meter
        self.prefix_tokens = meter.create_counter(
            "ballast_worker_kv_prefix_tokens",
            description="Context tokens of each session request by where their KV came from: "
            "memory (this worker's recent sessions), cache (restored) or computed.",
        )
        self.lookups = meter.create_counter(
            "ballast_worker_kv_lookups",
            description="Cache lookups by result: hit, miss, skipped (prefix too short to pay for one), unavailable.",
        )
        self.decisions = meter.create_counter(
            "ballast_worker_kv_decisions",
            description="Restore or recompute choices for a cached prefix, with the reason.",
        )
        self.restore_ms = telemetry.latency_histogram(
            "ballast_worker_kv_restore_ms", "Time to fetch and load a restored prefix."
        )
        self.restore_failures = meter.create_counter(
            "ballast_worker_kv_restore_failures",
            description="Restored blocks dropped: checksum mismatch, or a stream that broke.",
        )
        self.saves = meter.create_counter(
            "ballast_worker_kv_saves",
            description="Session saves by outcome: saved, unchanged, superseded, dropped "
            "(queue full), rejected, unavailable, error.",
        )
        self.saved_blocks = meter.create_counter(
            "ballast_worker_kv_saved_blocks", description="KV blocks written to the cache."
        )
        self.save_ms = telemetry.latency_histogram(
            "ballast_worker_kv_save_ms", "Time to save one session's new blocks."
        )
        self._queue_depth: Callable[[], int] = lambda: 0
        self._estimates: Callable[[], dict[str, float]] = dict
        meter.create_observable_gauge(
            "ballast_worker_kv_save_queue",
            callbacks=[self._observe_queue],
            description="Session saves waiting to be written.",
        )
        meter.create_observable_gauge(
            "ballast_worker_kv_estimated_ms",
            callbacks=[self._observe_estimates],
            description="Current estimate of restoring vs recomputing a 1024-token prefix.",
        )

    def watch(self, queue_depth: Callable[[], int], estimates: Callable[[], dict[str, float]]) -> None:
        self._queue_depth = queue_depth
        self._estimates = estimates

    def _observe_queue(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self._queue_depth())

    def _observe_estimates(self, _options: CallbackOptions) -> Iterable[Observation]:
        for path, value in self._estimates().items():
            yield Observation(value, {"path": path})
