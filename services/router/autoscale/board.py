"""Routers' window reports in etcd: each router keeps its own fresh under a lease; the leader
reads them all.

`<prefix>autoscale/reports/<router_id>` holds a `RouterReport` as JSON. The lease (a few
report intervals long) takes a dead router's report away, so the leader never decides on a
router that stopped measuring. Reports older than `max_age_s` are ignored as well: a router
whose clock or loop stalls must not pin the pool's p99. The lease is the session's
`KeptLease`: refreshed at each report, granted again when etcd lost it. The session is the
router's when given (the router closes it), else the board's own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from typing import Any

from services.common.config import EtcdConfig
from services.common.etcd_session import ETCD_ERRORS, EtcdSession
from services.common.tasks import stop_task
from services.router.autoscale.report import RouterReport

log = logging.getLogger(__name__)


def reports_prefix(config: EtcdConfig) -> str:
    return f"{config.prefix}autoscale/reports/"


class ReportBoard:
    def __init__(
        self,
        config: EtcdConfig,
        router_id: str,
        build: Callable[[], RouterReport],
        interval_s: float,
        clock: Callable[[], float] = time.time,
        session: EtcdSession | None = None,
    ) -> None:
        self.config = config
        self.router_id = router_id
        self._build = build
        self.interval_s = interval_s
        self._clock = clock
        self.ttl_s = max(2, round(interval_s * 3 + 0.49))
        self.max_age_s = max(self.ttl_s * 2.0, 10.0)
        self._owns_session = session is None
        self.session = session or EtcdSession(config)
        self._lease = self.session.kept_lease(self.ttl_s)
        self._task: asyncio.Task | None = None
        self.published = asyncio.Event()

    @property
    def key(self) -> bytes:
        return f"{reports_prefix(self.config)}{self.router_id}".encode()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="autoscale-reports")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        await self._lease.revoke()  # or it expires on its own
        if self._owns_session:
            await self.session.close()

    async def publish(self) -> None:
        lease_id = await self._lease.ensure()
        await self.session.put(self.key, self._build().to_json(), lease=lease_id)
        self.published.set()

    async def _run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.config.timeout_s * 2):
                    await self.publish()
            except ETCD_ERRORS as exc:
                # The failed call dropped its client already: the next report connects again.
                log.debug("could not publish the autoscaler report: %s", exc)
            await asyncio.sleep(self.interval_s)

    async def read_all(self, client: Any) -> list[RouterReport]:
        """Every live router's report, skipping malformed and stale ones (`client`: an
        EtcdSession or an aetcd client)."""
        now = self._clock()
        reports = []
        for kv in await client.get_prefix(reports_prefix(self.config).encode()):
            try:
                report = RouterReport.from_json(kv.value)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring malformed autoscaler report %s: %s", kv.key, exc)
                continue
            if now - report.at <= self.max_age_s:
                reports.append(report)
        return reports
