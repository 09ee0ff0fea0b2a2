"""The local mesh under a supervisor: what `ballast up` leaves running in the background.

`ballast up` writes the mesh's spec to STATE_DIR/supervise.json and starts
`python -m services.cli.supervised STATE_DIR` in a session of its own. That process starts
etcd, Redis and the broker (each bootstraps itself on its first start, as `Mesh` does), then
hands them to a `services.supervisor.Supervisor` with the cache, the backfill, the routers and
the workers, and supervises them all until SIGTERM: any process that dies is started again
(backoff 0.5 s doubling to 30 s), a worker over `worker.memory_limit_mb` is killed and started
again, and STATE_DIR/supervisor.json says, per process, its PID, restarts and last exit
reason. mesh.json keeps the current PIDs (and the supervisor's) for `ballast down`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from services.cli.localservers import LocalServer
from services.cli.mesh import Mesh, MeshSpec, ServiceProcess
from services.common.processes import ManagedProcess, ProcessStartError, read_log_tail
from services.supervisor import ChildSpec, GrpcHealthProbe, RestartPolicy, Supervisor, read_state

SPEC_FILE = "supervise.json"
STATE_FILE = "supervisor.json"
LOG_FILE = Path("logs") / "supervisor.log"
# Stages: the backing servers first, then every Ballast service together (they load in
# parallel, as `Mesh.start` does); stopped in reverse: workers, routers, backfill, cache, infra.
INFRA_STAGE, SERVICE_STAGE = 0, 1
# A worker drains its streams on SIGTERM before it exits.
SERVICE_STOP_GRACE_S = 30.0

log = logging.getLogger("ballast.cli.supervised")


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / STATE_FILE


def read_supervisor_state(state_dir: Path) -> dict | None:
    return read_state(state_path(state_dir))


def launch_daemon(spec: MeshSpec) -> ManagedProcess:
    """Starts the supervisor process for `spec` (a session of its own: it outlives the caller)."""
    state_dir = Path(spec.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    state_path(state_dir).unlink(missing_ok=True)
    (state_dir / SPEC_FILE).write_text(json.dumps(spec.to_json(), indent=2))
    process = ManagedProcess(
        "supervisor",
        [sys.executable, "-m", "services.cli.supervised", str(state_dir)],
        log_path=state_dir / LOG_FILE,
        env={"PYTHONUNBUFFERED": "1"},
    )
    return process.start()


def wait_daemon_ready(process: ManagedProcess, state_dir: Path, timeout: float) -> dict:
    """Blocks until the supervisor says every process is up; raises ProcessStartError (with its
    log's tail) when it fails or dies first."""
    deadline = time.monotonic() + timeout
    while True:
        state = read_supervisor_state(state_dir)
        if state is not None and state.get("phase") == "running":
            return state
        if state is not None and state.get("phase") == "failed" or not process.alive():
            error = (state or {}).get("error") or "the supervisor exited"
            raise ProcessStartError(
                f"the local mesh did not start: {error}", log_tail=read_log_tail(state_dir / LOG_FILE, 30)
            )
        if time.monotonic() >= deadline:
            raise ProcessStartError(
                f"the local mesh was not up after {timeout:.0f}s", log_tail=read_log_tail(state_dir / LOG_FILE, 30)
            )
        time.sleep(0.2)


class SupervisedMesh:
    """A `Mesh` whose processes a `Supervisor` runs and restarts."""

    def __init__(self, spec: MeshSpec) -> None:
        self.mesh = Mesh(spec)
        self.state_dir = self.mesh.state_dir
        self.supervisor: Supervisor | None = None

    def _infra_child(self, server: LocalServer) -> ChildSpec:
        process = server.process
        assert process is not None

        def started(fresh: ManagedProcess) -> None:
            # The server object stays the mesh's view of it (its pid in mesh.json, its probe).
            server.process = fresh
            server._launched_at = time.monotonic()

        return ChildSpec(
            server.name,
            process.argv,
            server.log_path,
            env=process.env,
            cwd=process.cwd,
            ready=server._probe,
            stage=INFRA_STAGE,
            start_timeout_s=server.default_start_timeout,
            stop_grace_s=server.stop_timeout,
            policy=RestartPolicy(),
            on_started=started,
            address=server.address,
        )

    def _service_child(self, service: ServiceProcess, memory_limit_mb: int) -> ChildSpec:
        def started(fresh: ManagedProcess) -> None:
            service.process = fresh

        process = service.process
        return ChildSpec(
            service.name,
            process.argv,
            process.log_path,
            env=process.env,
            cwd=process.cwd,
            ready=self._health_probe(service.address),
            stage=SERVICE_STAGE,
            start_timeout_s=self.mesh.spec.start_timeout_s,
            stop_grace_s=SERVICE_STOP_GRACE_S,
            memory_limit_mb=memory_limit_mb,
            on_started=started,
            address=service.address,
            metrics_port=service.metrics_port,
        )

    def _health_probe(self, address: str) -> GrpcHealthProbe:
        from services.cli.certs import CA_CERT, cert_path, key_path

        if not self.mesh.spec.secure:
            return GrpcHealthProbe(address)
        certs = self.mesh.certs_dir
        return GrpcHealthProbe(
            address,
            root_certificates=(certs / CA_CERT).read_bytes(),
            private_key=key_path(certs, "cli").read_bytes(),
            certificate_chain=cert_path(certs, "cli").read_bytes(),
        )

    def _services(self) -> list[ServiceProcess]:
        mesh = self.mesh
        services = [mesh._service_process(name, f"services.{name}", {}) for name in ("cache", "backfill", "router")]
        services += [mesh._new_router(port) for port in mesh._extra_router_ports()]
        services += mesh.initial_workers()
        return services

    def start(self) -> None:
        """The backing servers as `Mesh.start` starts them, then everything under the supervisor."""
        from services.config import load_config

        mesh = self.mesh
        mesh.extra_state = {
            "supervisor": {"pid": os.getpid(), "argv0": sys.executable, "state": str(state_path(self.state_dir))}
        }
        mesh.state_dir.mkdir(parents=True, exist_ok=True)
        mesh.ensure_certs()
        try:
            for server in mesh.infra:
                server.launch()
            mesh.save_state()
            for server in mesh.infra:
                server.wait_ready()
        except BaseException:
            for server in reversed(mesh.infra):
                server.stop()
            raise
        mesh.write_config()
        worker = load_config(mesh.config_path, environ={}).worker
        # Under a keeper (worker.respawn) the keeper holds its worker to the limit itself.
        worker_limit = 0 if worker.respawn else worker.memory_limit_mb
        services = self._services()
        mesh.services.extend(services)
        parts = [part for infra in mesh.infra for part in infra.parts()]
        children = [self._infra_child(part) for part in parts]
        children += [self._service_child(s, worker_limit if s.kind == "worker" else 0) for s in services]
        self.supervisor = Supervisor(children, state_path(self.state_dir), on_change=lambda _state: mesh.save_state())
        self.supervisor.extra_state = {"state_dir": str(self.state_dir)}
        for part in parts:
            assert part.process is not None
            self.supervisor.adopt(part.name, part.process)
        self.supervisor.start()

    def run(self) -> None:
        assert self.supervisor is not None
        self.supervisor.run()

    def request_stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.request_stop()

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        else:
            for server in reversed(self.mesh.infra):
                server.stop()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m services.cli.supervised STATE_DIR", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state_dir = Path(args[0]).resolve()
    spec = MeshSpec.from_json(json.loads((state_dir / SPEC_FILE).read_text()))
    supervised = SupervisedMesh(spec)
    stopping = []

    def on_signal(signum, _frame) -> None:
        log.info("supervisor: %s, stopping the mesh", signal.Signals(signum).name)
        stopping.append(signum)
        supervised.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        supervised.start()
    except BaseException as exc:
        log.error("supervisor: the mesh did not start: %s", exc)
        from services.supervisor import write_state

        write_state(
            state_path(state_dir),
            {"pid": os.getpid(), "phase": "failed", "error": str(exc).split("\n")[0], "children": []},
        )
        supervised.stop()
        return 1
    log.info("supervisor: the mesh is up; supervising")
    try:
        if not stopping:
            supervised.run()
    finally:
        supervised.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
