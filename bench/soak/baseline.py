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
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.common import metric_sum
from bench.soak.clients import RoundRobinTransport
from bench.soak.faults import (
    WORKER_FAULTS,
    WORKER_HOT,
    WORKER_KILL,
    WORKER_STALL,
    ScheduledFault,
    Throttle,
    Struck,
    Victims,
    signal_tree,
)
from services.common.processes import ManagedProcess, ProcessStartError, free_ports, wait_until_ready

READY_TIMEOUT_S = {"vllm": 400.0, "torch": 120.0, "sim": 60.0}
HEALTH_PERIOD_S = 1.0
MAX_NUM_SEQS = 8


@dataclass
class PlainServer:
    name: str
    port: int
    # Its own process group (the server and its engine process), started again after a kill.
    process: ManagedProcess

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.alive()


def _get(url: str, timeout: float = 1.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.read().decode() if reply.status == 200 else None
    except OSError:
        return None


def vllm_server_argv(model_dir: Path, model_name: str, port: int, max_num_seqs: int = MAX_NUM_SEQS) -> list[str]:
    """vLLM's own OpenAI server on 127.0.0.1:`port`, with the engine settings Ballast's vLLM
    workers use (float32, eager, prefix caching, `max_num_seqs` running): the plain baseline
    of the soak and of bench.worker_front."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        model_name,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--max-num-seqs",
        str(max_num_seqs),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def running_requests(port: int) -> float | None:
    """Requests the server is running now, from its /metrics (vLLM's or the stand-in's); None
    when it does not answer (still starting)."""
    return metric_sum(port, ("vllm:num_requests_running", "plain_requests_running"))


def kv_fragmentation(port: int) -> float | None:
    """The stand-in server's KV fragmentation, where its engine reports one. vLLM's own server
    exports the share of KV blocks in use but not the tokens they hold: None."""
    return metric_sum(port, ("plain_kv_fragmentation_ratio",))


class PlainFleet:
    """N plain servers, their balancer's rotation, restarts and the plain autoscaler."""

    def __init__(
        self,
        engine: str,
        model_dir: Path,
        model_name: str,
        state_dir: Path,
        sim_profile: Path | None,
        transport: RoundRobinTransport,
    ) -> None:
        self.engine, self.model_dir, self.model_name = engine, Path(model_dir).resolve(), model_name
        self.state_dir = Path(state_dir)
        self.sim_profile = sim_profile
        self.transport = transport
        self.servers: list[PlainServer] = []
        self._lock = threading.Lock()
        self._victims = Victims()
        self._health_task: asyncio.Task | None = None

    # -- processes --------------------------------------------------------------------------

    def _argv(self, port: int) -> list[str]:
        if self.engine == "vllm":
            return vllm_server_argv(self.model_dir, self.model_name, port)
        argv = [
            sys.executable,
            "-m",
            "bench.plain_server",
            "--engine",
            self.engine,
            "--model-dir",
            str(self.model_dir),
            "--model-name",
            self.model_name,
            "--port",
            str(port),
            "--max-concurrency",
            str(MAX_NUM_SEQS),
        ]
        if self.sim_profile is not None:
            argv += ["--sim-profile", str(self.sim_profile)]
        return argv

    def _env(self, core: int) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1"}
        if self.engine == "vllm":
            env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(core))
        return env

    def _wait_healthy(self, server: PlainServer) -> float:
        """Waits for the server's health check; returns the monotonic time it answered."""
        wait_until_ready(
            server.process,
            lambda: _get(f"http://127.0.0.1:{server.port}/health") is not None,
            READY_TIMEOUT_S[self.engine],
            interval=0.2,
            what="healthy",
        )
        return time.monotonic()

    def _new_server(self) -> PlainServer:
        """A server started (not yet healthy)."""
        with self._lock:
            index = len(self.servers)
            name, port, core = f"plain-{index + 1}", free_ports(1)[0], index % (os.cpu_count() or 1)
            process = ManagedProcess(
                name, self._argv(port), log_path=self.state_dir / f"{name}.log", env=self._env(core)
            )
            server = PlainServer(name=name, port=port, process=process)
            self.servers.append(server)
        server.process.start()
        return server

    def start(self, count: int) -> None:
        fresh = [self._new_server() for _ in range(count)]
        for server in fresh:
            self._wait_healthy(server)
        self.transport.set_ports([s.port for s in fresh])

    def add_server(self) -> float:
        """What a plain autoscaler does on a breach: cold-starts one more server; returns the
        monotonic time it answered its health check (it joins the rotation on the next probe)."""
        return self._wait_healthy(self._new_server())

    def stop(self) -> None:
        """Stops every server (SIGTERM to its group, then SIGKILL)."""
        for server in self.servers:
            server.process.stop(timeout=20)

    # -- the balancer's readiness probe ----------------------------------------------------------

    async def _probe_forever(self) -> None:
        while True:
            answers = await asyncio.gather(
                *(asyncio.to_thread(_get, f"http://127.0.0.1:{s.port}/health") for s in self.servers)
            )
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

    def apply(self, fault: ScheduledFault) -> Struck:
        def alive() -> list[PlainServer]:
            return [s for s in self.servers if s.alive()]

        with self._victims.busiest(alive, lambda s: s.name, lambda s: running_requests(s.port)) as server:
            return self._apply_to(server, fault)

    def _apply_to(self, server: PlainServer, fault: ScheduledFault) -> Struck:
        struck_at = time.monotonic()
        if fault.kind == WORKER_KILL:
            server.process.kill()  # the server and its engine process
            # The restart policy: the same server started again, from cold.
            server.process.start()
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
            return Struck(server.name, struck_at, self._wait_healthy(server))
        except ProcessStartError:
            return Struck(server.name, struck_at, None)

    def fragmentation(self) -> list[float]:
        values = [kv_fragmentation(s.port) for s in self.servers if s.alive()]
        return [v for v in values if v is not None]
