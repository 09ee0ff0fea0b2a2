"""The soak's baseline: plain OpenAI-compatible servers, as a team without Ballast runs them.

With the vLLM engine each server is vLLM's own OpenAI server (`vllm.entrypoints.openai.
api_server`, what `vllm serve` runs) with the settings Ballast's vLLM worker uses (float32,
eager, prefix caching, 8 sequences, 1 GiB of KV space, one core per engine). With the torch
and sim engines, which have no server of their own, `bench.plain_server` stands in.

What such a deployment has, and this fleet does:
- a round-robin balancer with a readiness probe: every second each server's /health is
  asked; a server that fails it leaves the rotation, one that answers joins it;
- a restart policy: a server that died is started again from cold (as a pod's container is);
- a plain autoscaler: when the clients' p99 breaches, a new server is cold-started and joins
  the rotation once ready.
What it does not have: tiers, failover of a stream, degradation, temperature awareness.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.soak_clients import RoundRobinTransport
from bench.soak_faults import WORKER_FAULTS, WORKER_HOT, WORKER_KILL, WORKER_STALL, ScheduledFault, Throttle, signal_tree
from services.common.processes import free_ports

READY_TIMEOUT_S = {"vllm": 400.0, "torch": 120.0, "sim": 60.0}
HEALTH_PERIOD_S = 1.0
MAX_NUM_SEQS = 8


@dataclass
class PlainServer:
    name: str
    port: int
    core: int
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    # Processes started under this server's name (restarts included): all are stopped at the end.
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def _get(url: str, timeout: float = 1.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.read().decode() if reply.status == 200 else None
    except OSError:
        return None


def running_requests(port: int) -> float:
    """Requests the server is running now, from its /metrics (vLLM's or the stand-in's)."""
    text = _get(f"http://127.0.0.1:{port}/metrics", timeout=2.0) or ""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "plain_requests_running")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def kv_fragmentation(port: int) -> float | None:
    """The stand-in server's KV fragmentation, where its engine reports one. vLLM's own server
    exports the share of KV blocks in use but not the tokens they hold: None."""
    text = _get(f"http://127.0.0.1:{port}/metrics", timeout=2.0) or ""
    for line in text.splitlines():
        if line.startswith("plain_kv_fragmentation_ratio"):
            return float(line.rsplit(" ", 1)[1])
    return None


class PlainFleet:
    """N plain servers, their balancer's rotation, restarts and the plain autoscaler."""

    def __init__(self, engine: str, model_dir: Path, model_name: str, state_dir: Path, sim_profile: Path | None,
                 transport: RoundRobinTransport) -> None:
        self.engine, self.model_dir, self.model_name = engine, Path(model_dir).resolve(), model_name
        self.state_dir = Path(state_dir)
        self.sim_profile = sim_profile
        self.transport = transport
        self.servers: list[PlainServer] = []
        self._lock = threading.Lock()
        # Servers under a fault now: a second fault picks another one.
        self._faulted: set[str] = set()
        self._faulted_lock = threading.Lock()
        self._health_task: asyncio.Task | None = None

    # -- processes --------------------------------------------------------------------------

    def _argv(self, server: PlainServer) -> list[str]:
        if self.engine == "vllm":
            return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                    "--served-model-name", self.model_name, "--dtype", "float32", "--enforce-eager",
                    "--enable-prefix-caching", "--max-num-seqs", str(MAX_NUM_SEQS), "--host", "127.0.0.1",
                    "--port", str(server.port)]
        argv = [sys.executable, "-m", "bench.plain_server", "--engine", self.engine, "--model-dir", str(self.model_dir),
                "--model-name", self.model_name, "--port", str(server.port), "--max-concurrency", str(MAX_NUM_SEQS)]
        if self.sim_profile is not None:
            argv += ["--sim-profile", str(self.sim_profile)]
        return argv

    def _env(self, server: PlainServer) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.engine == "vllm":
            env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(server.core))
        return env

    def _launch(self, server: PlainServer) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        server.log_path = self.state_dir / f"{server.name}.log"
        with open(server.log_path, "ab") as log:
            # Its own session: the server and its engine process are one group, stopped together.
            server.process = subprocess.Popen(self._argv(server), stdout=log, stderr=subprocess.STDOUT,
                                              env=self._env(server), start_new_session=True)
        server.processes.append(server.process)

    def _wait_healthy(self, server: PlainServer, timeout: float | None = None) -> float:
        deadline = time.monotonic() + (timeout or READY_TIMEOUT_S[self.engine])
        while time.monotonic() < deadline:
            if not server.alive():
                raise RuntimeError(f"{server.name} exited while starting; see {server.log_path}")
            if _get(f"http://127.0.0.1:{server.port}/health") is not None:
                return time.monotonic()
            time.sleep(0.2)
        raise TimeoutError(f"{server.name} not healthy after {timeout or READY_TIMEOUT_S[self.engine]:.0f}s")

    def _new_server(self) -> PlainServer:
        with self._lock:
            index = len(self.servers)
            server = PlainServer(name=f"plain-{index + 1}", port=free_ports(1)[0], core=index % (os.cpu_count() or 1))
            self.servers.append(server)
        return server

    def start(self, count: int) -> None:
        fresh = [self._new_server() for _ in range(count)]
        for server in fresh:
            self._launch(server)
        for server in fresh:
            self._wait_healthy(server)
        self.transport.set_ports([s.port for s in fresh])

    def add_server(self) -> float:
        """What a plain autoscaler does on a breach: cold-starts one more server; returns the
        monotonic time it answered its health check (it joins the rotation on the next probe)."""
        server = self._new_server()
        self._launch(server)
        return self._wait_healthy(server)

    def stop(self) -> None:
        """Stops every process this fleet started, by PID (SIGTERM to its group, then SIGKILL)."""
        for server in self.servers:
            for process in server.processes:
                _stop_group(process)

    # -- the balancer's readiness probe ----------------------------------------------------------

    async def _probe_forever(self) -> None:
        while True:
            answers = await asyncio.gather(*(asyncio.to_thread(_get, f"http://127.0.0.1:{s.port}/health")
                                             for s in self.servers))
            self.transport.set_ports([s.port for s, answer in zip(self.servers, answers) if answer is not None])
            await asyncio.sleep(HEALTH_PERIOD_S)

    def start_probe(self) -> None:
        self._health_task = asyncio.get_running_loop().create_task(self._probe_forever())

    async def stop_probe(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)

    # -- faults ------------------------------------------------------------------------------

    def kinds(self) -> tuple[str, ...]:
        return WORKER_FAULTS

    def _victim(self) -> PlainServer:
        """The busiest server not under another fault (any, when every one is), so the fault
        hits work in flight; it counts as under this fault until `apply` ends."""
        with self._faulted_lock:
            alive = [s for s in self.servers if s.alive()]
            free = [s for s in alive if s.name not in self._faulted] or alive
            victim = max(free, key=lambda s: running_requests(s.port))
            self._faulted.add(victim.name)
            return victim

    def apply(self, fault: ScheduledFault) -> tuple[str, float | None]:
        server = self._victim()
        try:
            return self._apply_to(server, fault)
        finally:
            with self._faulted_lock:
                self._faulted.discard(server.name)

    def _apply_to(self, server: PlainServer, fault: ScheduledFault) -> tuple[str, float | None]:
        if fault.kind == WORKER_KILL:
            _kill_group(server.pid)
            server.process.wait()
            # The restart policy: the same server started again, from cold.
            self._launch(server)
        elif fault.kind == WORKER_STALL:
            signal_tree(server.pid, signal.SIGSTOP)
            time.sleep(fault.hold_s)
            signal_tree(server.pid, signal.SIGCONT)
        elif fault.kind == WORKER_HOT:
            # Nothing here reads a temperature: the server just runs at half speed while hot.
            throttle = Throttle(server.pid).start()
            time.sleep(fault.hold_s)
            throttle.stop()
        else:
            raise ValueError(f"the baseline has no part for fault {fault.kind!r}")
        try:
            return server.name, self._wait_healthy(server)
        except (TimeoutError, RuntimeError):
            return server.name, None

    def fragmentation(self) -> list[float]:
        values = [kv_fragmentation(s.port) for s in self.servers if s.alive()]
        return [v for v in values if v is not None]


def _kill_group(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the server's group (its engine process too), SIGKILL after `grace_s`."""
    pid = process.pid
    if process.poll() is not None and not _group_alive(pid):
        return
    try:
        os.killpg(pid, signal.SIGCONT)  # a stopped group cannot act on SIGTERM
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        process.poll()  # reaps the leader: a zombie leader would keep the group "alive"
        if not _group_alive(pid):
            return
        time.sleep(0.2)
    _kill_group(pid)
    process.wait()
