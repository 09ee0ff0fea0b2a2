"""Warm standby of one worker: start with the model loaded but unroutable, serve on promotion.

A worker started with `worker.standby` loads its engine, registers with `standby: true` (and
`healthy: false`, so no router sends it work) and watches its role key
(`services.common.worker_roles`). Promotion wakes the engine when it sleeps (vLLM sleep
mode) and republishes the record at once: routers see a routable worker within a watch
round trip. A demotion stops new work from arriving; streams already running finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from services.common.config import EtcdConfig
from services.common.etcd_session import EtcdSession
from services.common.etcd_watch import KeyWatcher
from services.common.tasks import stop_task
from services.common.worker_roles import SERVING, STANDBY, parse_role, role_key
from services.worker.engine import Engine, Wakeable

log = logging.getLogger(__name__)


class StandbyControl:
    """This worker's role, and the watch of its role key."""

    def __init__(
        self,
        config: EtcdConfig,
        worker_id: str,
        engine: Engine,
        standby: bool,
        publish: Callable[[], None],
        session: EtcdSession | None = None,
    ) -> None:
        self.standby = standby
        self.promoted_in_s: float | None = None
        """How long the last promotion took, from the role change seen to the record published."""
        self._engine = engine
        self._publish = publish
        # Over the worker's etcd session (None: one of the watch's own).
        self._watch = KeyWatcher(config, role_key(config, worker_id), self._on_role, session)
        self._switch: asyncio.Task | None = None

    async def start(self) -> None:
        await self._watch.start()

    async def stop(self) -> None:
        await self._watch.stop()
        await stop_task(self._switch)

    def _on_role(self, value: bytes | None) -> None:
        role = parse_role(value)
        # A deleted key (the lease renewed) or a stray value changes nothing.
        if role == SERVING and self.standby:
            self._switch = asyncio.create_task(self._promote(), name="standby-promote")
        elif role == STANDBY and not self.standby:
            self.standby = True
            self._publish()
            log.info("demoted to warm standby")

    async def _promote(self) -> None:
        started = time.perf_counter()
        if isinstance(self._engine, Wakeable):
            await self._engine.wake_up()  # vLLM sleep mode: weights back on the GPU before taking work
        self.standby = False
        self._publish()
        self.promoted_in_s = time.perf_counter() - started
        log.info("promoted from warm standby in %.0f ms", self.promoted_in_s * 1000)
