"""The cache service's metrics: hits, misses by reason, bytes in and out, checksum failures,
the evictions Redis reports under its memory bound, and on a Redis Cluster its health as this
service sees it.

The running totals are also kept as plain numbers, so the Stats RPC can answer without
scraping the Prometheus registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.metrics import Observation

from services.common.redis_client import ClusterHealth
from services.common.telemetry import Telemetry


@dataclass
class CacheTotals:
    hits: int = 0
    misses: int = 0
    checksum_failures: int = 0
    bytes_stored: int = 0
    bytes_served: int = 0
    evicted_keys_seen: int = 0


class CacheMetrics:
    def __init__(self, telemetry: Telemetry) -> None:
        meter = telemetry.meter
        self.totals = CacheTotals()
        self._hits = meter.create_counter("ballast_cache_hits", description="Blocks served by Get.")
        self._misses = meter.create_counter(
            "ballast_cache_misses",
            description="Gets that stopped short of the asked blocks, by reason of the first miss "
            "(absent, corrupt, partial, mismatch).",
        )
        self._bytes = meter.create_counter(
            "ballast_cache_bytes", unit="By", description="Block bytes stored (in) and served (out)."
        )
        self._checksum_failures = meter.create_counter(
            "ballast_cache_checksum_failures",
            description="Blocks whose bytes did not match their checksum, on Put or in the store.",
        )
        self._evictions = meter.create_counter(
            "ballast_cache_evictions", description="Keys Redis evicted under its memory bound, as seen by this service."
        )
        self._rejected = meter.create_counter(
            "ballast_cache_rejected_blocks", description="Blocks not stored, by reason (checksum, no_room)."
        )
        self.latency = telemetry.latency_histogram("ballast_cache_call_ms", "Time to serve a KVCache call, by method.")
        #: The last Redis Cluster health read (None on one Redis server, or before the first read).
        self.cluster: ClusterHealth | None = None
        meter.create_observable_gauge(
            "ballast_cache_redis_cluster_ok",
            callbacks=[self._observe_cluster_ok],
            description="Redis Cluster only: 1 while the cluster says its state is ok and every "
            "master answers this service.",
        )
        meter.create_observable_gauge(
            "ballast_cache_redis_cluster_slots_ok",
            callbacks=[self._observe_slots_ok],
            description="Redis Cluster only: hash slots served by a reachable master (16384 when whole).",
        )
        meter.create_observable_gauge(
            "ballast_cache_redis_cluster_masters",
            callbacks=[self._observe_masters],
            description="Redis Cluster only: masters in the slot map (state=known) and those that "
            "answered this service (state=reachable).",
        )

    def hit(self, blocks: int, size: int) -> None:
        if blocks:
            self._hits.add(blocks)
            self._bytes.add(size, {"direction": "out"})
            self.totals.hits += blocks
            self.totals.bytes_served += size

    def miss(self, reason: str) -> None:
        self._misses.add(1, {"reason": reason})
        self.totals.misses += 1
        if reason == "corrupt":
            self.checksum_failure()

    def checksum_failure(self) -> None:
        self._checksum_failures.add(1)
        self.totals.checksum_failures += 1

    def stored(self, size: int) -> None:
        self._bytes.add(size, {"direction": "in"})
        self.totals.bytes_stored += size

    def rejected(self, reason: str) -> None:
        self._rejected.add(1, {"reason": reason})
        if reason == "checksum":
            self.checksum_failure()

    def evictions_seen(self, count: int) -> None:
        if count > 0:
            self._evictions.add(count)
            self.totals.evicted_keys_seen += count

    def cluster_seen(self, health: ClusterHealth) -> None:
        self.cluster = health

    def _observe_cluster_ok(self, _options):
        health = self.cluster
        if health is None:
            return []
        whole = health.state_ok and health.masters_reachable == health.masters
        return [Observation(1 if whole else 0)]

    def _observe_slots_ok(self, _options):
        return [] if self.cluster is None else [Observation(self.cluster.slots_ok)]

    def _observe_masters(self, _options):
        health = self.cluster
        if health is None:
            return []
        return [
            Observation(health.masters, {"state": "known"}),
            Observation(health.masters_reachable, {"state": "reachable"}),
        ]
