"""Periodic reachability checks of a dependency, feeding health and the dependency gauge."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from services.common.telemetry import DependencyStatus
from services.common.tasks import stop_task

log = logging.getLogger(__name__)


class DependencyProbe:
    """Calls `check` every `interval_s` (each call bounded by `timeout_s`); records up/down."""

    def __init__(
        self,
        name: str,
        check: Callable[[], Awaitable[object]],
        dependencies: DependencyStatus,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        on_change: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self._check = check
        self._dependencies = dependencies
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._on_change = on_change
        self._task: asyncio.Task | None = None
        self._last: bool | None = None

    async def probe_once(self) -> bool:
        try:
            # asyncio.timeout, not wait_for: wait_for can swallow the cancel that stops us.
            async with asyncio.timeout(self._timeout_s):
                await self._check()
            up = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._last is not False:
                log.warning("%s unreachable: %s", self.name, exc)
            up = False
        self._dependencies.set(self.name, up)
        if up != self._last:
            if up and self._last is False:
                log.info("%s reachable again", self.name)
            self._last = up
            if self._on_change is not None:
                await self._on_change(up)
        return up

    async def _run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self._interval_s)

    async def start(self) -> None:
        await self.probe_once()
        self._task = asyncio.create_task(self._run(), name=f"probe-{self.name}")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
