"""A process's self-measurement that runs beside its work: a task on the running loop started
and stopped with the service, and warnings about what it measures kept to one line a minute.
"""

from __future__ import annotations

import asyncio


class LoopSampler:
    """Runs `_run` (a subclass's endless sampling loop) as one task on the running loop."""

    task_name = "sampler"

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Starts sampling on the running loop (a no-op when already started); RuntimeError
        without a running loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.task_name)

    def stop(self) -> None:
        """Cancels the task: it only sleeps and samples, so nothing is left half done."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        raise NotImplementedError


class WarningEvery:
    """Lets one warning through per `every_s`, counting the occurrences each one stands for:
    a condition that lasts is logged, not flooded."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._since_last = 0
        self._last_at: float | None = None

    def occurred(self, now: float) -> int | None:
        """Counts one occurrence at `now`; returns how many the warning due now stands for
        (this one and those held back since the last), or None when none is due."""
        self._since_last += 1
        if self._last_at is not None and now - self._last_at < self.every_s:
            return None
        count, self._since_last, self._last_at = self._since_last, 0, now
        return count
