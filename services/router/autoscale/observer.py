"""The router's own autoscaler windows per pool, fed from its request path.

Requests name a model; the autoscaler scales pools. A model's pool is read from the
membership (the pool its workers register in), so the light model's traffic on the
degradation ladder lands in the light pool. Requests of a model no worker serves are not
counted: there is no pool to scale for them.

`RouterObservations` registers with the request path through its public hooks: as an
observer of the generation runner (arrivals, TTFT, e2e) and as a listener of the router's
queue waits. The request path knows nothing of the autoscaler and, when it is off, has no
observer to call.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

from services.common.membership import WorkerRecord
from services.router.autoscale.decision import PoolAutoscaler
from services.router.autoscale.policy import AutoscalerConfig
from services.router.autoscale.report import PoolReport, RouterReport


def pool_of_model(workers: Mapping[str, WorkerRecord], model: str) -> str | None:
    """The pool whose workers serve `model` (the most common one, should they disagree)."""
    counts: dict[str, int] = {}
    for worker in workers.values():
        if worker.model == model:
            counts[worker.pool] = counts.get(worker.pool, 0) + 1
    return max(counts, key=counts.get) if counts else None


class RouterObservations:
    """Sliding windows of this router's requests, one `PoolAutoscaler` per managed pool."""

    def __init__(
        self,
        config: AutoscalerConfig,
        pool_of: Callable[[str], str | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pools = {name: PoolAutoscaler(name, policy) for name, policy in config.pools.items()}
        self._pool_of = pool_of
        self._clock = clock

    def _pool(self, model: str) -> PoolAutoscaler | None:
        name = self._pool_of(model)
        return None if name is None else self.pools.get(name)

    def arrival(self, model: str) -> None:
        pool = self._pool(model)
        if pool is not None:
            pool.observe_arrivals(self._clock())

    def ttft(self, model: str, ms: float) -> None:
        pool = self._pool(model)
        if pool is not None:
            pool.observe_ttft(self._clock(), ms)

    def e2e(self, model: str, ms: float) -> None:
        pool = self._pool(model)
        if pool is not None:
            pool.observe_e2e(self._clock(), ms)

    def queue_wait(self, model: str, ms: float) -> None:
        """A queue wait; the scheduler labels it with the model as its `pool`."""
        if not model:
            return
        pool = self._pool(model)
        if pool is not None:
            pool.observe_queue_wait(self._clock(), ms)

    def report(self, router_id: str) -> RouterReport:
        now = self._clock()
        return RouterReport(router_id, now, {name: PoolReport.of(pool, now) for name, pool in self.pools.items()})
