"""Several router processes on one port (`router.processes`), so that one router uses N cores.

A router is one asyncio loop, so one core. With `router.processes: N` the `ballast-router`
process becomes a small parent: it starts N children, each a whole router bound to the same
ports. gRPC servers listen with SO_REUSEPORT (gRPC's default on Linux) and the HTTP front asks
for it, so the kernel spreads new client connections over the children. A child knows its
place from `BALLAST_ROUTER_PROCESS` ("index/count") and serves its share (`config_for_slot`):
1/N of every per-tenant quota, its own outbox file, /metrics on the metrics port plus its
index. Everything else a router keeps (membership, breakers, the quarantine) each child keeps
for itself, as separate routers do.

The parent prints one READY line once every child has (and a `PROCESS router i/N pid=P
metrics=M` line at each child's start), restarts a child that dies (after the shared restart
backoff) and, on SIGTERM or SIGINT, stops them all (SIGTERM, SIGKILL after the
router's shutdown grace).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.backoff import BackoffPolicy, RestartBackoff
from services.common.lifecycle import catch_stop_signals
from services.config import BallastConfig

log = logging.getLogger(__name__)

# Set in a child: "index/count".
SLOT_ENV = "BALLAST_ROUTER_PROCESS"
# How long a child may take to print its READY line.
CHILD_START_TIMEOUT_S = 120.0
# Beyond the router's own shutdown grace, before a child that does not stop is killed.
STOP_MARGIN_S = 5.0


@dataclass(frozen=True)
class Slot:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> "Slot":
        index, _, count = text.partition("/")
        slot = cls(int(index), int(count))
        if not 0 <= slot.index < slot.count:
            raise ValueError(f"{SLOT_ENV}={text!r}: expected index/count with 0 <= index < count")
        return slot

    def env(self) -> str:
        return f"{self.index}/{self.count}"


def current_slot(environ: dict[str, str] | None = None) -> Slot | None:
    """This process's place in its router's group; None when it is not a child."""
    value = (os.environ if environ is None else environ).get(SLOT_ENV)
    return Slot.parse(value) if value else None


def outbox_path_for(path: str, index: int) -> str:
    """Child 0 keeps the configured outbox (so a router that grew from one process keeps its
    undrained records); the others get a file of their own beside it."""
    if index == 0 or not path:
        return path
    file = Path(path)
    return str(file.with_name(f"{file.stem}.{index}{file.suffix}"))


def config_for_slot(config: BallastConfig, slot: Slot) -> BallastConfig:
    """The config of one child: its share of the quotas, its outbox, its metrics port."""
    router = config.router.model_copy(update={"quotas": config.router.quotas.shared_by(slot.count)})
    port = config.telemetry.metrics_port
    telemetry = config.telemetry.model_copy(update={"metrics_port": port + slot.index if port else 0})
    degrade = config.degrade.model_copy(update={"outbox_path": outbox_path_for(config.degrade.outbox_path, slot.index)})
    return config.model_copy(update={"router": router, "telemetry": telemetry, "degrade": degrade})


class _Child:
    """One child process and what it said."""

    def __init__(self, slot: Slot, argv: list[str]) -> None:
        self.slot = slot
        self.argv = argv
        self.process: asyncio.subprocess.Process | None = None
        self.ready: asyncio.Future[str] | None = None
        self.started_at = 0.0
        self.backoff = RestartBackoff(BackoffPolicy())
        self._relay: asyncio.Task | None = None

    async def start(self) -> None:
        env = {**os.environ, SLOT_ENV: self.slot.env()}
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.router", *self.argv, env=env, stdout=asyncio.subprocess.PIPE
        )
        self.ready = asyncio.get_running_loop().create_future()
        self.started_at = time.monotonic()
        self._relay = asyncio.create_task(self._relay_output())

    async def _relay_output(self) -> None:
        """Passes the child's standard output on, keeping its READY line for the parent's."""
        assert self.process is not None and self.process.stdout is not None and self.ready is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith("READY router "):
                # Each start of a child, for operators and tests: which process holds which slot.
                print(f"PROCESS router {self.slot.env()} pid={self.process.pid} {line.split()[-1]}", flush=True)
                if not self.ready.done():
                    self.ready.set_result(line)
                continue
            print(line, flush=True)

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


async def run_group(config: BallastConfig, argv: list[str]) -> None:
    """The parent of `config.router.processes` routers started with `argv`; returns once
    stopped by a signal."""
    count = config.router.processes
    children = [_Child(Slot(i, count), argv) for i in range(count)]
    stop = catch_stop_signals()
    for child in children:
        await child.start()
    ready: asyncio.Future[list[str]] = asyncio.gather(*(child.ready for child in children if child.ready is not None))
    waits: set[asyncio.Future] = {stop, ready}
    await asyncio.wait(waits, timeout=CHILD_START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
    if ready.done():
        # The first child's line, as it is: its address is every child's, its metrics port the base.
        print(ready.result()[0], flush=True)
    elif not stop.done():
        log.error("not every router process got ready within %.0f s", CHILD_START_TIMEOUT_S)
    watchers = {asyncio.create_task(_keep(child, stop)) for child in children}
    await stop
    log.info("stopping %d router processes", count)
    await _stop_all(children, config.router.shutdown_grace_s + STOP_MARGIN_S)
    for watcher in watchers:
        watcher.cancel()
    ready.cancel()


async def _keep(child: _Child, stop: asyncio.Future[str]) -> None:
    """Starts `child` again whenever it dies, until the group stops."""
    while not stop.done():
        assert child.process is not None
        code = await child.process.wait()
        if stop.done():
            return
        delay = child.backoff.next_delay(time.monotonic() - child.started_at)
        log.error("router process %s exited (%s); starting it again in %.1f s", child.slot.env(), code, delay)
        await asyncio.sleep(delay)
        if not stop.done():
            await child.start()


async def _stop_all(children: list[_Child], grace_s: float) -> None:
    for child in children:
        child.signal(signal.SIGTERM)
    waits = [child.process.wait() for child in children if child.process is not None]
    try:
        async with asyncio.timeout(grace_s):
            await asyncio.gather(*waits)
    except TimeoutError:
        for child in children:
            child.signal(signal.SIGKILL)
        await asyncio.gather(*(child.process.wait() for child in children if child.process is not None))
