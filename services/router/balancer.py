"""Picks the worker for a request from the live membership. Pure logic, no network.

A worker is eligible when it serves the requested model, is healthy and not draining,
and has not already failed this request. Among eligible workers the one with the fewest
requests in flight wins: the router's own count is exact and immediate, the published
count (refreshed each heartbeat) covers other routers; the larger of the two is used.
"""

from __future__ import annotations

import random
from typing import Iterable, Mapping

from services.common.membership import WorkerRecord


def eligible(workers: Iterable[WorkerRecord], model: str, exclude: frozenset[str] = frozenset()) -> list[WorkerRecord]:
    return [w for w in workers if w.model == model and w.routable and w.id not in exclude]


def load_of(worker: WorkerRecord, local_in_flight: Mapping[str, int]) -> float:
    in_flight = max(worker.in_flight, local_in_flight.get(worker.id, 0))
    return in_flight / max(1, worker.capacity)


def pick_worker(
    workers: Iterable[WorkerRecord],
    model: str,
    local_in_flight: Mapping[str, int],
    exclude: frozenset[str] = frozenset(),
    rng: random.Random | None = None,
) -> WorkerRecord | None:
    candidates = eligible(workers, model, exclude)
    if not candidates:
        return None
    rng = rng or random
    # Random tie-break, so equal workers share a burst instead of the first one taking it.
    return min(candidates, key=lambda w: (load_of(w, local_in_flight), rng.random()))
