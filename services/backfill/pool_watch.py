"""Wakes replays that wait for a primary pool as soon as etcd shows the pool back.

A replay the router refuses with "no live worker" waits and tries again. Waiting out a fixed
backoff after the pool has returned adds that backoff to every ticket's lag, so the wait
also ends when etcd's worker records show a routable primary worker for the request's model.
When etcd already shows one (the router still refuses: a breaker is open, say), the plain
backoff applies, so a disagreement between the two views cannot turn into a busy loop.
etcd is optional here: without it, replays just wait out their backoff.
"""

from __future__ import annotations

import asyncio

from services.common.membership import MembershipWatcher, WorkerRecord


def routable_primary(workers: dict[str, WorkerRecord], model: str) -> bool:
    return any(
        w.pool == "primary" and w.model == model and w.healthy and not w.draining and not w.standby
        for w in workers.values()
    )


class PrimaryPoolWatch:
    def __init__(self, membership: MembershipWatcher) -> None:
        self._membership = membership

    def ready(self, model: str) -> bool:
        return routable_primary(self._membership.workers(), model)

    async def wait_ready(self, model: str, timeout_s: float) -> bool:
        """Waits up to `timeout_s`; True when it ended because the pool came back."""
        if self.ready(model):
            await asyncio.sleep(timeout_s)
            return False
        return await self._membership.wait_for(lambda workers: routable_primary(workers, model), timeout_s)
