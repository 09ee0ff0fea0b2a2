"""What each router tells the elected leader about a pool, and how the leader merges it.

Every router measures the requests it relays (its own sliding windows, `PoolAutoscaler`'s
observation half) and publishes a summary per pool. A p99 cannot be averaged across routers,
so latencies travel as sparse log-bucket histograms (4 % wide, reported at the bucket's
geometric middle: within 2 % of the true value) that add up exactly; the leader takes the
percentile of the sum. Request rates add up too (each router sees its own share). The queue
wait is per router (each has its own queue in front of the same pool): the leader takes the
router whose fitted wait is highest, since a queue growing anywhere means the pool is short.

Pure: JSON in, `PoolSignals` out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from services.router.autoscale.decision import PoolAutoscaler, PoolSignals

BUCKET_RATIO = 1.04
"""Relative width of a histogram bucket."""
FLOOR_MS = 0.1
"""Latencies at or below this share bucket 0."""


def bucket_of(ms: float) -> int:
    if ms <= FLOOR_MS:
        return 0
    return math.ceil(math.log(ms / FLOOR_MS, BUCKET_RATIO))


def bucket_value(index: int) -> float:
    """The geometric middle of bucket `index`, which holds (FLOOR x R^(i-1), FLOOR x R^i]."""
    if index <= 0:
        return FLOOR_MS
    return FLOOR_MS * BUCKET_RATIO ** (index - 0.5)


def histogram(values: Iterable[float]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for value in values:
        index = bucket_of(value)
        counts[index] = counts.get(index, 0) + 1
    return counts


def merged_percentile(histograms: Iterable[Mapping[int, int]], quantile: float, min_samples: int) -> float | None:
    """Nearest-rank percentile of the sum of `histograms`; None with fewer than `min_samples`."""
    total: dict[int, int] = {}
    for counts in histograms:
        for index, count in counts.items():
            total[index] = total.get(index, 0) + count
    samples = sum(total.values())
    if samples < max(1, min_samples):
        return None
    rank = max(1, math.ceil(quantile * samples))
    seen = 0
    for index in sorted(total):
        seen += total[index]
        if seen >= rank:
            return bucket_value(index)
    raise AssertionError("rank beyond the sample count")  # unreachable: rank <= samples


@dataclass(frozen=True)
class PoolReport:
    """One router's view of one pool over its windows."""

    ttft: Mapping[int, int] = field(default_factory=dict)
    e2e: Mapping[int, int] = field(default_factory=dict)
    queue_wait_ms: float | None = None
    queue_wait_slope_ms_per_min: float | None = None
    request_rate: float = 0.0
    baseline_rate: float | None = None

    @classmethod
    def of(cls, pool: PoolAutoscaler, now: float) -> "PoolReport":
        ttft, e2e = pool.latency_values(now)
        signals = pool.signals(now)
        return cls(
            ttft=histogram(ttft),
            e2e=histogram(e2e),
            queue_wait_ms=signals.queue_wait_ms,
            queue_wait_slope_ms_per_min=signals.queue_wait_slope_ms_per_min,
            request_rate=signals.request_rate,
            baseline_rate=signals.baseline_rate,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            # JSON keys are strings; bucket indices come back as ints in from_dict.
            "ttft": {str(k): v for k, v in self.ttft.items()},
            "e2e": {str(k): v for k, v in self.e2e.items()},
            "queue_wait_ms": self.queue_wait_ms,
            "queue_wait_slope_ms_per_min": self.queue_wait_slope_ms_per_min,
            "request_rate": self.request_rate,
            "baseline_rate": self.baseline_rate,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PoolReport":
        return cls(
            ttft={int(k): int(v) for k, v in (data.get("ttft") or {}).items()},
            e2e={int(k): int(v) for k, v in (data.get("e2e") or {}).items()},
            queue_wait_ms=_optional_float(data.get("queue_wait_ms")),
            queue_wait_slope_ms_per_min=_optional_float(data.get("queue_wait_slope_ms_per_min")),
            request_rate=float(data.get("request_rate") or 0.0),
            baseline_rate=_optional_float(data.get("baseline_rate")),
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class RouterReport:
    """Everything one router publishes: its pools' reports, stamped with who and when."""

    router: str
    at: float
    pools: Mapping[str, PoolReport]

    def to_json(self) -> bytes:
        return json.dumps(
            {"router": self.router, "at": self.at, "pools": {k: v.to_dict() for k, v in self.pools.items()}},
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "RouterReport":
        data = json.loads(raw)
        return cls(
            router=str(data["router"]),
            at=float(data["at"]),
            pools={name: PoolReport.from_dict(pool) for name, pool in (data.get("pools") or {}).items()},
        )


def merge(reports: Iterable[PoolReport], min_samples: int) -> PoolSignals:
    """The pool's signals over every router's report."""
    reports = list(reports)
    ttft = [r.ttft for r in reports]
    queued = [r for r in reports if r.queue_wait_ms is not None]
    worst_queue = max(queued, key=lambda r: r.queue_wait_ms) if queued else None
    # A router too new to have a baseline would make any rate look like a surge next to the
    # others' baselines: compare only routers that have one, on both sides.
    with_baseline = [r for r in reports if r.baseline_rate is not None]
    rated = with_baseline or reports
    return PoolSignals(
        p99_ttft_ms=merged_percentile(ttft, 0.99, min_samples),
        p99_e2e_ms=merged_percentile((r.e2e for r in reports), 0.99, min_samples),
        latency_samples=sum(sum(counts.values()) for counts in ttft),
        queue_wait_ms=None if worst_queue is None else worst_queue.queue_wait_ms,
        queue_wait_slope_ms_per_min=None if worst_queue is None else worst_queue.queue_wait_slope_ms_per_min,
        request_rate=sum(r.request_rate for r in rated),
        baseline_rate=sum(r.baseline_rate for r in with_baseline) if with_baseline else None,
    )
