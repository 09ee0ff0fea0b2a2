"""Several simulated workers in one process: `python -m services.worker.sim.host --count N`.

Each is a whole worker (services.worker.app): its own gRPC server on its own port, its own
etcd record and lease, metrics endpoint and fault knobs; they share the process's event loop
and memory, so 64 of them fit on a small machine where 64 processes would not. Worker ids are
`{worker.id or host-pid}-{i}`. One READY line per worker, as `ballast-worker` prints.

A worker told to crash (`{"crash": true}`) dies alone, as a killed process would: its server
stops at once (streams in flight break) and its lease is left to expire. `--restart-after S`
brings a crashed worker back (a new incarnation, new lease, same id and port) S seconds
later, as a keeper would restart a process.

The process holds one etcd session, built here and shared by every worker (their records,
leases and watches): a crashed worker's lease is left to expire and its watches stop, and the
others' go on. The host closes the session after every worker stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys

from services.common import event_loop
from services.common.config import ConfigError
from services.common.etcd_session import EtcdSession
from services.common.lifecycle import catch_stop_signals, setup_logging
from services.config import BallastConfig, load_config
from services.worker.app import WorkerApp, create_server

log = logging.getLogger(__name__)


class SimHost:
    def __init__(self, config: BallastConfig, count: int, restart_after_s: float | None = None) -> None:
        if config.worker.engine != "sim":
            raise ConfigError("config field 'worker.engine': a sim host runs sim workers only")
        self.config = config
        self.count = count
        self.restart_after_s = restart_after_s
        self.base_id = config.worker.id or f"{socket.gethostname()}-{os.getpid()}"
        self.apps: dict[int, WorkerApp] = {}
        self._ports: dict[int, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self.crashes = 0
        # The process's one etcd session: every worker's, closed by shutdown() after them.
        self.etcd = EtcdSession(config.etcd)

    def _config_for(self, index: int) -> BallastConfig:
        worker = self.config.worker.model_copy(
            update={
                "id": f"{self.base_id}-{index}",
                # A restarted incarnation takes its old port back, as a restarted process would.
                "port": self._ports.get(index, self.config.worker.port if self.count == 1 else 0),
            }
        )
        return self.config.model_copy(update={"worker": worker})

    async def start_worker(self, index: int) -> WorkerApp:
        app = await create_server(self._config_for(index), on_crash=lambda: self._crash_soon(index), etcd=self.etcd)
        self.apps[index] = app
        self._ports[index] = app.port
        print(f"READY worker {app.address} metrics={app.telemetry.port} id={app.worker_id}", flush=True)
        return app

    async def start(self) -> None:
        for index in range(self.count):
            await self.start_worker(index)

    def _crash_soon(self, index: int) -> None:
        task = asyncio.get_running_loop().create_task(self._crash(index))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _crash(self, index: int) -> None:
        app = self.apps.pop(index, None)
        if app is None:
            return
        self.crashes += 1
        log.warning("sim fault: worker %s crashes", app.worker_id)
        # No drain, no goodbye: streams in flight break, the lease is left to expire. Its watches
        # end as a dead process's would; the session stays, the other workers' go on.
        await app.registration.abandon()
        if app.sim_faults is not None:
            await app.sim_faults.stop()
        if app.standby is not None:
            await app.standby.stop()
        await app.server.stop(0)
        await app.engine.stop()
        app.telemetry.stop()
        if self.restart_after_s is not None:
            await asyncio.sleep(self.restart_after_s)
            await self._clear_crash_knob(app)
            await self.start_worker(index)

    async def _clear_crash_knob(self, app: WorkerApp) -> None:
        # The new incarnation reads the same fault key: a crash knob left there would end it
        # again at once.
        from services.worker.sim.faults import faults_key

        try:
            await self.etcd.delete(faults_key(self.config.etcd.prefix, app.worker_id).encode())
        except Exception as exc:  # noqa: BLE001 - etcd away: the incarnation may crash again, said in the log
            log.warning("could not clear the crash knob of %s: %s", app.worker_id, exc)

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(app.shutdown() for app in self.apps.values()), return_exceptions=True)
        # Last: every worker above deregistered through it.
        await self.etcd.close()


async def serve(config: BallastConfig, count: int, restart_after_s: float | None) -> None:
    host = SimHost(config, count, restart_after_s)
    stop = catch_stop_signals()  # before the READY lines
    await host.start()
    signal_name = await stop
    log.info("%s received, shutting down %d sim workers", signal_name, len(host.apps))
    await host.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ballast-sim-host", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="ballast.yaml (default: $BALLAST_CONFIG)")
    parser.add_argument("--count", type=int, default=4, help="sim workers in this process")
    parser.add_argument(
        "--restart-after",
        type=float,
        default=None,
        help="seconds after a crash before the worker comes back (default: it stays down)",
    )
    args = parser.parse_args(argv)
    setup_logging("sim-host")
    try:
        config = load_config(args.config)
        if args.count < 1:
            raise ConfigError("--count must be at least 1")
    except ConfigError as exc:
        print(f"ballast-sim-host: {exc}", file=sys.stderr)
        return 2
    event_loop.run(serve(config, args.count, args.restart_after), config.runtime.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
