"""vLLM's scheduler stats (running, waiting, KV-cache use) for the worker's heartbeat, and its
steps counted.

AsyncLLM hands SchedulerStats to every stat logger after each engine step. A small logger
(`SchedulerStatsSink.logger_class`) keeps the latest snapshot; `engine_stats` turns it into
EngineStats, whose kv_used goes into the etcd record. The stats only move when the engine
steps, so an idle engine's last snapshot can be stale (a request aborted after the last step
still counts as running): the engine's own count of requests in flight bounds them, and with
nothing in flight nothing runs and no KV is held by requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from services.worker.engine import EngineStats


@dataclass(frozen=True)
class SchedulerSnapshot:
    running: int
    waiting: int
    kv_usage: float  # 0..1 of the KV blocks held by requests
    at: float  # monotonic time it was recorded


def snapshot_of(stats: Any, now: float | None = None) -> SchedulerSnapshot:
    """Reads a vLLM SchedulerStats: `kv_cache_usage` in recent releases, `gpu_cache_usage`
    in earlier V1 ones."""
    usage = getattr(stats, "kv_cache_usage", None)
    if usage is None:
        usage = getattr(stats, "gpu_cache_usage", 0.0)
    return SchedulerSnapshot(
        running=max(0, int(getattr(stats, "num_running_reqs", 0) or 0)),
        waiting=max(0, int(getattr(stats, "num_waiting_reqs", 0) or 0)),
        kv_usage=min(1.0, max(0.0, float(usage or 0.0))),
        at=time.monotonic() if now is None else now,
    )


class SchedulerStatsSink:
    """The latest scheduler snapshot, written by a vLLM stat logger."""

    def __init__(self) -> None:
        self.latest: SchedulerSnapshot | None = None
        # Engine steps that computed: vLLM hands every step's stats over, a step that only
        # prefilled (no token out yet) included, and also the empty steps it loops through
        # while its only requests wait (for a grammar compile, for remote KV): those, with no
        # request running, are not counted.
        self.steps = 0
        # Receives the KV connector's counts (a dict) whenever a step reports some.
        self.connector_callback: Callable[[dict[str, float]], None] | None = None

    def record(self, scheduler_stats: Any) -> None:
        if scheduler_stats is None:
            return
        self.latest = snapshot_of(scheduler_stats)
        if self.latest.running:
            self.steps += 1
        counts = getattr(scheduler_stats, "kv_connector_stats", None)
        if counts and self.connector_callback is not None:
            self.connector_callback(dict(counts))

    def logger_class(self, base: type) -> type:
        """A StatLoggerBase subclass writing into this sink. vLLM calls a logger factory with
        (vllm_config, engine_index); the class is that factory."""
        sink = self

        class BallastStatLogger(base):  # type: ignore[misc, valid-type]
            def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            # The signature grew keyword arguments across releases (mm_cache_stats,
            # engine_idx); only the first one is read.
            def record(self, scheduler_stats: Any = None, *args: Any, **kwargs: Any) -> None:
                sink.record(scheduler_stats)

            def log_engine_initialized(self) -> None:
                pass

            def log(self) -> None:
                pass

        return BallastStatLogger


def engine_stats(
    snapshot: SchedulerSnapshot | None,
    in_flight: int,
    max_concurrency: int,
    kv_capacity_tokens: int,
    extra: dict[str, float],
) -> EngineStats:
    """EngineStats from the latest snapshot, bounded by the requests actually in flight."""
    capacity = max(1, kv_capacity_tokens)
    if in_flight <= 0:
        return EngineStats(0, 0, 0, capacity, extra)
    if snapshot is None:
        running = min(in_flight, max_concurrency)
        return EngineStats(running, in_flight - running, 0, capacity, extra)
    running = min(snapshot.running, in_flight)
    waiting = min(snapshot.waiting, in_flight - running)
    return EngineStats(running, waiting, round(snapshot.kv_usage * capacity), capacity, extra)


def kv_fragmentation(kv_usage: float, capacity_tokens: int, block_tokens: int | None, held_tokens: int) -> float | None:
    """KV slots allocated but holding no token, over the slots allocated (the seed alerts at
    15 %): vLLM allocates whole blocks, so a request's last block is partly empty. Allocated
    slots come from vLLM's block usage, held tokens from the requests in flight. Approximate
    where requests share prefix blocks (a shared block counts once, its tokens per request,
    so sharing reads as less fragmentation). None when nothing is allocated."""
    if not block_tokens or capacity_tokens <= 0:
        return None
    allocated = round(kv_usage * capacity_tokens / block_tokens) * block_tokens
    if allocated <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - held_tokens / allocated))
