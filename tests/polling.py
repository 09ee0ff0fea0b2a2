"""Waiting for a condition in async tests: poll with a generous bound, never a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from typing import Callable


async def poll(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """True as soon as `predicate()` holds; False if it still does not after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return predicate()
