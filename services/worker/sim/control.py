"""Applies a simulated worker's fault knobs while it runs.

The knobs come from the config at start and from the etcd key `faults_key(prefix, id)`
afterwards (a KeyWatcher; without the key, or once it is deleted, the config's hold). The engine takes its own knobs
(fail after k tokens, hang, slowdown); this puts the rest where the worker reads them: the
reported temperature, health (NOT_SERVING, new requests refused, the etcd record unhealthy)
and a crash, which `on_crash` carries out (the process exits, or a multi-worker host stops
that one worker abruptly). A value that does not parse is logged and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from services.common.config import EtcdConfig
from services.common.etcd_session import EtcdSession
from services.common.etcd_watch import KeyWatcher
from services.worker.servicer import FaultInjector
from services.worker.sim.engine import SimEngine
from services.worker.sim.faults import SimFaults, SimFaultsError, faults_key
from services.worker.temperature import TemperatureSource

log = logging.getLogger(__name__)


class SimFaultControl:
    def __init__(
        self,
        etcd: EtcdConfig,
        worker_id: str,
        engine: SimEngine,
        temperature: TemperatureSource,
        refusals: FaultInjector,
        set_health: Callable[[bool], Awaitable[None]],
        on_crash: Callable[[], None],
        session: EtcdSession | None = None,
    ) -> None:
        self.engine = engine
        self.temperature = temperature
        self.refusals = refusals
        self._set_health = set_health
        self._on_crash = on_crash
        engine.on_crash = on_crash  # a query of death (crash_on_marker) ends the worker the same way
        self.faults = engine.faults
        self._initial = engine.faults
        # Over the worker's etcd session (None: one of the watch's own).
        self._watch = KeyWatcher(etcd, faults_key(etcd.prefix, worker_id), self._on_value, session)
        self._health_task: asyncio.Task | None = None

    @property
    def unhealthy(self) -> bool:
        return self.faults.fail_health

    def apply(self, faults: SimFaults) -> None:
        previous, self.faults = self.faults, faults
        self.engine.set_faults(faults)
        self.temperature.override = faults.temperature_c
        self.refusals.refusing = faults.fail_health
        if faults.fail_health != previous.fail_health:
            self._health_task = asyncio.get_running_loop().create_task(self._set_health(not faults.fail_health))
        if faults != previous:
            log.info("sim faults now %s", faults.to_json())
        if faults.crash:
            self._on_crash()

    def _on_value(self, raw: bytes | None) -> None:
        if raw is None:
            self.apply(self._initial)
            return
        try:
            faults = SimFaults.from_json(raw)
        except SimFaultsError as exc:
            log.warning("ignored sim fault setting: %s", exc)
            return
        self.apply(faults)

    async def start(self) -> None:
        self.apply(self.faults)
        if self.faults.fail_health:
            await self._set_health(False)
        await self._watch.start()

    async def stop(self) -> None:
        await self._watch.stop()
