"""Keeps better answers for `backfill.answer_retention_s`, then removes them.

Nothing the backfill stores carries a Redis TTL (memory pressure must never evict a promised
answer), so retention is enforced here: a task sweeps the store's index by time every
`retention_sweep_s`, a bounded batch at a time. Every replica sweeps; the steps repeat safely.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from services.backfill.store import AnswerStore
from services.common.redis_client import UNAVAILABLE_ERRORS
from services.common.tasks import stop_task

log = logging.getLogger(__name__)
# Tickets per sweep call, and sweep calls per round: a backlog drains over a few rounds
# instead of holding Redis in one long loop.
SWEEP_BATCH = 500
BATCHES_PER_ROUND = 20


class RetentionSweeper:
    def __init__(self, store: AnswerStore, interval_s: float) -> None:
        self.store = store
        self.interval_s = interval_s
        self.swept = 0
        self._task: asyncio.Task | None = None

    async def sweep_round(self) -> int:
        """One round: batches until the store has nothing past retention (or the round's bound)."""
        total = 0
        for _ in range(BATCHES_PER_ROUND):
            swept = await self.store.sweep(batch=SWEEP_BATCH)
            total += swept
            if swept < SWEEP_BATCH:
                break
        self.swept += total
        return total

    async def _run(self) -> None:
        while True:
            try:
                swept = await self.sweep_round()
                if swept:
                    log.info("removed %d better answers past their retention", swept)
            except asyncio.CancelledError:
                raise
            except (RedisError, *UNAVAILABLE_ERRORS) as exc:
                log.debug("retention sweep skipped, Redis unavailable: %r", exc)
            await asyncio.sleep(self.interval_s)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="backfill-retention")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
