"""Stopping background tasks for sure.

`task.cancel(); await task` can wait forever on Python 3.11: when the task is inside
`asyncio.wait_for` and the awaited thing completes in the same loop iteration as the cancel,
`wait_for` returns its result and the cancellation is lost, so a `while True` loop simply goes
on. `stop_task` cancels again until the task is really done, and gives up after a bound so a
shutdown can never hang on one task.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

# How long one cancel is given before it is repeated.
RECANCEL_INTERVAL_S = 0.5


async def stop_task(task: asyncio.Task | None, timeout_s: float = 10.0) -> bool:
    """Cancels `task` and waits until it is done; True when it ended within `timeout_s`.

    Exceptions the task ends with are logged, not raised: this is a shutdown path.
    """
    if task is None or task is asyncio.current_task():
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            log.warning("task %s did not stop within %.1fs", task.get_name(), timeout_s)
            return False
        task.cancel()
        # asyncio.wait never raises for the task's outcome and is not cancelled by it.
        await asyncio.wait({task}, timeout=min(RECANCEL_INTERVAL_S, remaining))
    if not task.cancelled() and task.exception() is not None:
        log.warning("task %s ended with %r", task.get_name(), task.exception())
    return True


def cancelled_from_outside() -> bool:
    """True when the running task itself was asked to stop (a caller's deadline, a shutdown),
    False when a cancellation came from a call cut under it (a gRPC call whose channel closed)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0
