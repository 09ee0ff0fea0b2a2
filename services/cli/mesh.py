"""The local mesh: real etcd, Redis and Kafka broker processes, then the Ballast services.

`ballast up` and the integration tests share this launcher. Everything runs as child
processes with state and logs under one folder; `mesh.json` there records every PID (with
its argv[0], so `ballast down` never signals a process that is not ours) in start order,
and `down` stops them in reverse order.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from services.cli.certs import BACKING_SERVERS, CA_CERT, backing_password, cert_path, init_certs, key_path, role_env
from services.cli.etcd_cluster import LocalEtcdCluster
from services.cli.kafka_tls import SecureKafkaBroker
from services.cli.redis_cluster import LocalRedisCluster
from services.cli.localservers import BackingSecurity, EtcdServer, KafkaBroker, LocalServer, RedisServer, ServerGroup
from services.common.processes import (
    ManagedProcess,
    ProcessStartError,
    StopOutcome,
    free_ports,
    stop_pid,
    wait_until_ready,
)

STATE_FILE = "mesh.json"
# Redis's memory bound in a local mesh (split over the masters of a local Redis Cluster).
REDIS_MAXMEMORY = 256 * 1024 * 1024
CONFIG_FILE = "ballast.yaml"
CERTS_DIR = "certs"
LOCAL_API_KEY = "local-dev-key"
# The backfill service replays degraded requests through the router as this tenant.
BACKFILL_API_KEY = "local-backfill-key"
# The backfill's tenant (backfill.replay_tenant): its keys act for the tenants that degraded.
BACKFILL_TENANT = "ballast-backfill"


@dataclass
class MeshSpec:
    """What to start and where. Ports left at None are picked free at start."""

    state_dir: Path
    model_dir: Path
    workers: int = 2
    # The logical model the workers serve (what clients ask for).
    model_name: str = "tiny"
    # A light model's folder: one torch worker serves it as the light pool, the rung of the
    # degradation ladder between the primary pool and the rules. None: no light pool.
    light_model_dir: Path | None = None
    light_model_name: str = "tiny"
    router_port: int | None = None
    # The router's OpenAI-compatible HTTP front: on in a local mesh (a free port unless set).
    router_http_port: int | None = None
    etcd_port: int | None = None
    redis_port: int | None = None
    kafka_port: int | None = None
    cache_port: int | None = None
    backfill_port: int | None = None
    api_keys: dict[str, str] = field(
        default_factory=lambda: {LOCAL_API_KEY: "local", BACKFILL_API_KEY: "ballast-backfill"}
    )
    auth_enabled: bool = True
    lease_ttl_s: int = 3
    worker_capacity: int = 8
    # Extra config laid over the generated file (same shape as ballast.yaml).
    overrides: dict = field(default_factory=dict)
    # Per-worker files for tests: temperature override and fault injection, under state_dir.
    worker_test_files: bool = False
    # The workers' engine: torch (the small Llama on CPU) or vllm (vLLM's CPU build here).
    engine: str = "torch"
    # Mutual TLS between the services, with development certificates under state_dir/certs.
    secure: bool = False
    # Routers on the same etcd, cache and backfill: the first one on router_port with the HTTP
    # front, the others on the ports after it (or free ones), gRPC only.
    routers: int = 1
    # The cache and the backfill store on a local Redis Cluster (3 masters, 1 replica each)
    # instead of one Redis server.
    redis_cluster: bool = False
    # etcd as a cluster of three members (the services get every member's address).
    etcd_cluster: bool = False
    # The single local Redis keeps an append-only file (fsync every second) under
    # state_dir/redis, so a restart loses no stored answer: on for `ballast up`; off here by
    # default (a test mesh starts empty, and its KV blocks need not reach the disk).
    redis_persist: bool = False
    # Every service on gRPC and /metrics ports picked before it starts (workers too) and kept
    # across restarts: what a supervisor that restarts them and probes their health needs.
    fixed_ports: bool = False

    def to_json(self) -> dict:
        """The spec as JSON-ready data (paths as strings), for a process that starts it."""
        data = dict(self.__dict__)
        data["state_dir"], data["model_dir"] = str(self.state_dir), str(self.model_dir)
        data["light_model_dir"] = None if self.light_model_dir is None else str(self.light_model_dir)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "MeshSpec":
        light = data.get("light_model_dir")
        return cls(
            **{
                **data,
                "state_dir": Path(data["state_dir"]),
                "model_dir": Path(data["model_dir"]),
                "light_model_dir": None if light is None else Path(light),
            }
        )

    @property
    def worker_count(self) -> int:
        """Every worker the mesh starts: the primary pool's and the light pool's."""
        return self.workers + (1 if self.light_model_dir is not None else 0)

    @property
    def start_timeout_s(self) -> float:
        # vLLM imports for tens of seconds and starts an engine process: 30-80 s on two busy cores.
        return 400.0 if self.engine == "vllm" else 120.0


@dataclass
class ServiceProcess:
    """One Ballast service process and what its READY line told."""

    name: str
    process: ManagedProcess
    env: dict[str, str]
    address: str = ""
    metrics_port: int = 0
    args: tuple[str, ...] = ()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def kind(self) -> str:
        """What it runs, from its name: "worker-2" is a worker, "router-3" a router."""
        return self.name.split("-")[0]


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def local_auth(enabled: bool, api_keys: dict[str, str]) -> dict:
    """The auth section of a local mesh: the developer's key may claim every tier (the README's
    examples ask for S), and the backfill's key replays on behalf of the tenant that degraded."""
    keys: dict = {
        key: ({"tenant": tenant, "acts_for_tenants": True} if tenant == BACKFILL_TENANT else tenant)
        for key, tenant in api_keys.items()
    }
    tenants = {api_keys[LOCAL_API_KEY]: {"tiers": ["S", "A", "B"]}} if LOCAL_API_KEY in api_keys else {}
    return {"enabled": enabled, "api_keys": keys, "tenants": tenants}


def engine_settings(engine: str, model_dir: Path) -> dict:
    """The worker settings an engine needs on this machine. vLLM requires an explicit KV dtype:
    the weights' own (read from config.json); on CPUs no CUDA graphs (eager mode)."""
    if engine == "torch":
        return {"engine": "torch"}
    if engine == "vllm":
        from services.worker.vllm.checks import read_model_facts

        facts = read_model_facts(model_dir)
        return {"engine": "vllm", "kv_cache_dtype": facts.weights_dtype or "float32", "enforce_eager": True}
    if engine == "sim":
        return {"engine": "sim"}
    raise ValueError(f"unknown engine {engine!r}: torch, vllm or sim")


def _read_ready_lines(log_path: Path, offset: int, name: str) -> list[str]:
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.startswith(f"READY {name} ")]


def _take_ready_line(service: ServiceProcess, line: str) -> None:
    # READY <kind> <address> metrics=<port>
    parts = line.split()
    service.address = parts[-2]
    service.metrics_port = int(parts[-1].split("=", 1)[1])


def _read_ready_line(log_path: Path, offset: int, name: str) -> str | None:
    lines = _read_ready_lines(log_path, offset, name)
    return lines[0] if lines else None


@dataclass(frozen=True)
class SimWorker:
    """One worker of a sim host, from its READY line."""

    id: str
    address: str
    metrics_port: int

    @classmethod
    def from_ready_line(cls, line: str) -> "SimWorker":
        # READY worker <address> metrics=<port> id=<worker id>
        _ready, _kind, address, *fields = line.split()
        named = dict(field.split("=", 1) for field in fields if "=" in field)
        return cls(id=named.get("id", ""), address=address, metrics_port=int(named["metrics"]))


class Mesh:
    """A running local mesh. Start with `start()`; stop with `stop()` (reverse order)."""

    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec
        self.state_dir = Path(spec.state_dir).resolve()
        self.certs_dir = self.state_dir / CERTS_DIR
        # --secure also secures etcd and Redis (TLS with client certificates and a user) and
        # the Kafka broker (TLS with client certificates).
        self.security = BackingSecurity(self.certs_dir, backing_password(self.certs_dir)) if spec.secure else None
        if spec.secure and (spec.redis_cluster or spec.etcd_cluster):
            # The bundled Valkey has no TLS, and the local clusters are not secured.
            raise ValueError(
                "the local Redis Cluster and etcd cluster run without TLS: --secure and "
                "clusters together are not supported"
            )
        if spec.routers < 1:
            raise ValueError("a mesh needs at least one router")
        self.etcd: EtcdServer | LocalEtcdCluster = (
            LocalEtcdCluster(self.state_dir, members=3)
            if spec.etcd_cluster
            else EtcdServer(self.state_dir, spec.etcd_port, security=self.security)
        )
        self.redis: RedisServer | LocalRedisCluster = (
            LocalRedisCluster(self.state_dir, masters=3, replicas_per_master=1, maxmemory=REDIS_MAXMEMORY // 3)
            if spec.redis_cluster
            else RedisServer(
                self.state_dir,
                spec.redis_port,
                maxmemory=REDIS_MAXMEMORY,
                security=self.security,
                appendonly=spec.redis_persist,
            )
        )
        # The broker has no TLS of its own: secured, it sits behind a TLS front.
        self.kafka = (
            SecureKafkaBroker(self.state_dir, spec.kafka_port, security=self.security)
            if self.security
            else KafkaBroker(self.state_dir, spec.kafka_port)
        )
        # Picked together, so no two of them are the same port.
        picked = iter(free_ports(4))
        self.router_port = spec.router_port or next(picked)
        self.router_http_port = spec.router_http_port or next(picked)
        self.cache_port = spec.cache_port or next(picked)
        self.backfill_port = spec.backfill_port or next(picked)
        self.config_path = self.state_dir / CONFIG_FILE
        self.infra: list[LocalServer | ServerGroup] = [self.etcd, self.redis, self.kafka]
        self.services: list[ServiceProcess] = []
        self._worker_seq = 0
        self._router_seq = 1  # "router" is the first
        self._host_seq = 0
        # Restarts may run in threads (fault benchmarks): guard the service list and mesh.json.
        self._lock = threading.RLock()
        # Laid over mesh.json's top level (a supervisor records itself there).
        self.extra_state: dict = {}

    # -- config -----------------------------------------------------------------------------

    def config_dict(self) -> dict:
        spec = self.spec
        config = {
            "etcd": {
                "host": self.etcd.host,
                "port": self.etcd.port,
                "lease_ttl_s": spec.lease_ttl_s,
                **({"endpoints": self.etcd.endpoints} if spec.etcd_cluster else {}),
            },
            # On the local cluster every master has one replica: backfill writes wait for it.
            "redis": (
                {"url": self.redis.url, "cluster": True, "wait_replicas": 1}
                if spec.redis_cluster
                else {"url": self.redis.url}
            ),
            "kafka": {"bootstrap": f"{self.kafka.host}:{self.kafka.port}"},
            "auth": local_auth(spec.auth_enabled, spec.api_keys),
            # Subscribe and GetBackfill on the router relay to this mesh's backfill service.
            "router": {
                "port": self.router_port,
                "http_port": self.router_http_port,
                "backfill_address": f"127.0.0.1:{self.backfill_port}",
            },
            "cache": {"port": self.cache_port},
            "backfill": {"port": self.backfill_port},
            "worker": {
                "model_dir": str(Path(spec.model_dir).resolve()),
                "model_name": spec.model_name,
                "max_concurrency": spec.worker_capacity,
                "cache_address": f"127.0.0.1:{self.cache_port}",
                **engine_settings(spec.engine, Path(spec.model_dir)),
            },
        }
        if spec.light_model_dir is not None:
            # The primary pool degrades to the light model, then to the rules.
            config["router"]["models"] = [spec.model_name, spec.light_model_name]
            config["degrade"] = {"ladders": {spec.model_name: [spec.light_model_name, "rules"]}}
        if spec.secure:
            # The file names the cli's certificate (what `ballast chat` and `ballast status`
            # present); each service process is pointed at its own by environment
            # (_service_process).
            tls = {
                "enabled": True,
                "ca_file": str(self.certs_dir / CA_CERT),
                "cert_file": str(cert_path(self.certs_dir, "cli")),
                "key_file": str(key_path(self.certs_dir, "cli")),
            }
            config["tls"] = tls
            assert self.security is not None
            user = {"username": self.security.username, "password": self.security.password}
            config["etcd"].update(user, tls=dict(tls))
            config["redis"].update(user, tls=dict(tls))
            config["kafka"]["tls"] = dict(tls)
        return _merge(config, spec.overrides)

    def ensure_certs(self) -> None:
        """The development CA and certificates, made on the first secure start."""
        if not self.spec.secure:
            return
        if not (self.certs_dir / CA_CERT).exists():
            init_certs(self.certs_dir)
            return
        # A directory made before a server was secured lacks that server's certificate.
        missing = tuple(role for role in BACKING_SERVERS if not cert_path(self.certs_dir, role).exists())
        if missing:
            init_certs(self.certs_dir, roles=missing)

    def write_config(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.ensure_certs()
        text = (
            "# Generated by `ballast up` for this local mesh; edit deploy/local/ballast.yaml instead.\n"
            + yaml.safe_dump(self.config_dict(), sort_keys=False)
        )
        # With --secure it holds the etcd and Redis password: readable by its owner only.
        tmp = self.config_path.with_name(self.config_path.name + ".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.config_path)

    # -- services ---------------------------------------------------------------------------

    def _service_process(
        self, name: str, module: str, env: dict[str, str], args: tuple[str, ...] = ()
    ) -> ServiceProcess:
        env = {"BALLAST_CONFIG": str(self.config_path), "PYTHONUNBUFFERED": "1", **env}
        if self.spec.secure:
            env = {**role_env(self.certs_dir, name.split("-")[0], backing=BACKING_SERVERS), **env}
        address, metrics_port = "", 0
        if self.spec.fixed_ports:
            env, address, metrics_port = self._fixed_ports(name, env)
        process = ManagedProcess(
            name,
            [sys.executable, "-m", module, *args],
            log_path=self.state_dir / "logs" / f"{name}.log",
            env=env,
            cwd=self.state_dir,
        )
        return ServiceProcess(name, process, env, address=address, metrics_port=metrics_port, args=tuple(args))

    def _fixed_ports(self, name: str, env: dict[str, str]) -> tuple[dict[str, str], str, int]:
        """Pins a service's /metrics port (and a worker's gRPC port) in its environment;
        returns the environment, its gRPC address and its metrics port."""
        grpc_port, metrics_port = free_ports(2)
        env = {**env, "BALLAST__TELEMETRY__METRICS_PORT": str(metrics_port)}
        kind = name.split("-")[0]
        if kind == "worker":
            env["BALLAST__WORKER__PORT"] = str(grpc_port)
        elif kind == "router":
            grpc_port = int(env.get("BALLAST__ROUTER__PORT", self.router_port))
        elif kind == "cache":
            grpc_port = self.cache_port
        elif kind == "backfill":
            grpc_port = self.backfill_port
        return env, f"127.0.0.1:{grpc_port}", metrics_port

    def _spawn(self, service: ServiceProcess) -> int:
        """Starts the process; returns the log offset its READY line will come after."""
        log_path = service.process.log_path
        offset = log_path.stat().st_size if log_path.exists() else 0
        service.process.start()
        return offset

    def _await_ready(self, service: ServiceProcess, kind: str, offset: int, timeout: float) -> ServiceProcess:
        ready: dict[str, str] = {}

        def probe() -> bool:
            line = _read_ready_line(service.process.log_path, offset, kind)
            if line:
                ready["line"] = line
            return line is not None

        wait_until_ready(service.process, probe, timeout, what="ready")
        _take_ready_line(service, ready["line"])
        return service

    def refresh_ready(self, service: ServiceProcess) -> ServiceProcess:
        """Takes the address and metrics port from the service's latest READY line: a worker
        its keeper started again listens on new ones."""
        lines = _read_ready_lines(service.process.log_path, 0, service.kind)
        if lines:
            _take_ready_line(service, lines[-1])
        return service

    def _launch_all(self, batch: list[tuple[ServiceProcess, str]], timeout: float) -> None:
        """Starts a batch of services at once (they load in parallel), then waits for each."""
        offsets = []
        for service, _kind in batch:
            self.services.append(service)
            offsets.append(self._spawn(service))
        self.save_state()
        for (service, kind), offset in zip(batch, offsets):
            self._await_ready(service, kind, offset, timeout)
        self.save_state()

    def temperature_file(self, worker_name: str) -> Path:
        return self.state_dir / "test-files" / f"{worker_name}.temperature"

    def fault_file(self, worker_name: str) -> Path:
        return self.state_dir / "test-files" / f"{worker_name}.fault"

    def _new_worker(self, extra_env: dict[str, str] | None = None) -> ServiceProcess:
        self._worker_seq += 1
        name = f"worker-{self._worker_seq}"
        env = {"BALLAST__WORKER__ID": name}
        if self.spec.engine == "vllm":
            # One core per vLLM engine, round robin: engines left to bind themselves all pick
            # the same core and spin against each other.
            env["BALLAST__WORKER__VLLM_CPU_THREADS_BIND"] = str((self._worker_seq - 1) % (os.cpu_count() or 1))
        if self.spec.worker_test_files:
            self.temperature_file(name).parent.mkdir(parents=True, exist_ok=True)
            env["BALLAST__WORKER__TEMPERATURE_FILE"] = str(self.temperature_file(name))
            env["BALLAST__WORKER__FAULT_FILE"] = str(self.fault_file(name))
        env.update(extra_env or {})
        return self._service_process(name, "services.worker", env)

    def _new_light_worker(self) -> ServiceProcess:
        """The light pool's worker: the light model on the torch engine (a small model that
        any engine's worker machine runs on its CPU)."""
        assert self.spec.light_model_dir is not None
        return self._service_process(
            "worker-light",
            "services.worker",
            {
                "BALLAST__WORKER__ID": "worker-light",
                "BALLAST__WORKER__MODEL_DIR": str(Path(self.spec.light_model_dir).resolve()),
                "BALLAST__WORKER__MODEL_NAME": self.spec.light_model_name,
                "BALLAST__WORKER__POOL": "light",
                "BALLAST__WORKER__ENGINE": "torch",
            },
        )

    def initial_workers(self) -> list[ServiceProcess]:
        """The workers a start launches: the primary pool's, then the light pool's."""
        workers = [self._new_worker() for _ in range(self.spec.workers)]
        if self.spec.light_model_dir is not None:
            workers.append(self._new_light_worker())
        return workers

    def start_worker(self, extra_env: dict[str, str] | None = None, timeout: float | None = None) -> ServiceProcess:
        service = self._new_worker(extra_env)
        self._launch_all([(service, "worker")], timeout or self.spec.start_timeout_s)
        return service

    def _new_router(self, port: int | None = None, processes: int = 1) -> ServiceProcess:
        self._router_seq += 1
        name = f"router-{self._router_seq}"
        # Each router replica keeps its own degraded-request outbox (a file one process holds).
        env = {
            "BALLAST__ROUTER__PORT": str(port or free_ports(1)[0]),
            "BALLAST__ROUTER__HTTP_PORT": "null",
            "BALLAST__DEGRADE__OUTBOX_PATH": f"outbox/{name}.sqlite",
            "BALLAST__ROUTER__PROCESSES": str(processes),
        }
        return self._service_process(name, "services.router", env)

    def _extra_router_ports(self) -> list[int | None]:
        """Ports of routers 2..N: after the first router's when it was given, else free ones."""
        count = self.spec.routers - 1
        if self.spec.router_port:
            return [self.spec.router_port + i for i in range(1, count + 1)]
        return [None] * count

    def start_router(self, timeout: float | None = None, processes: int = 1) -> ServiceProcess:
        """Another router on the same etcd, cache and backfill, on a port of its own and
        without the HTTP front: several routers share the clients (bench.mesh_scale). With
        `processes` > 1, one router of that many processes (router.processes)."""
        service = self._new_router(processes=processes)
        self._launch_all([(service, "router")], timeout or self.spec.start_timeout_s)
        return service

    def routers(self) -> list[ServiceProcess]:
        return [s for s in self.services if s.name == "router" or s.name.startswith("router-")]

    def start_sim_host(
        self, count: int, restart_after_s: float | None = None, timeout: float | None = None
    ) -> tuple[ServiceProcess, list[SimWorker]]:
        """`count` sim workers in one process (services.worker.sim.host), each registered in
        etcd on its own port; returns the process and its workers (in READY order)."""
        self._host_seq += 1
        name = f"simhost-{self._host_seq}"
        args = ["--count", str(count)]
        if restart_after_s is not None:
            args += ["--restart-after", str(restart_after_s)]
        service = self._service_process(name, "services.worker.sim.host", {"BALLAST__WORKER__ID": name}, tuple(args))
        with self._lock:
            self.services.append(service)
        offset = self._spawn(service)
        self.save_state()
        workers: list[SimWorker] = []

        def probe() -> bool:
            lines = _read_ready_lines(service.process.log_path, offset, "worker")
            workers[:] = [SimWorker.from_ready_line(line) for line in lines]
            return len(workers) >= count

        wait_until_ready(service.process, probe, timeout or self.spec.start_timeout_s, what="ready")
        service.address = workers[0].address
        self.save_state()
        return service, workers

    def restart_service(self, service: ServiceProcess, timeout: float | None = None) -> ServiceProcess:
        """Starts a stopped service again with the same identity and settings."""
        fresh = self._service_process(service.name, f"services.{service.kind}", dict(service.env))
        with self._lock:
            self.services[self.services.index(service)] = fresh
            offset = self._spawn(fresh)
            self.save_state()
        self._await_ready(fresh, fresh.kind, offset, timeout or self.spec.start_timeout_s)
        self.save_state()
        return fresh

    def await_ready_after(self, service: ServiceProcess, offset: int, timeout: float = 120.0) -> ServiceProcess:
        """Waits for a READY line written after log `offset`: a worker its keeper started
        again (worker.respawn) under the same process. Updates the service's address."""
        self._await_ready(service, service.kind, offset, timeout)
        self.save_state()
        return service

    def start(self, timeout: float | None = None) -> "Mesh":
        timeout = timeout or self.spec.start_timeout_s
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.ensure_certs()
            for server in self.infra:
                server.launch()
            self.save_state()
            for server in self.infra:
                server.wait_ready()
            self.write_config()
            batch = [
                (self._service_process(name, f"services.{name}", {}), name) for name in ("cache", "backfill", "router")
            ]
            batch += [(self._new_router(port), "router") for port in self._extra_router_ports()]
            batch += [(worker, "worker") for worker in self.initial_workers()]
            self._launch_all(batch, timeout)
            self.wait_for_workers(self.spec.worker_count, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_workers(self, count: int, timeout: float) -> None:
        """Blocks until `count` workers hold a lease in etcd."""
        wait_for_workers(self.config_path, count, timeout)

    @property
    def router_address(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    @property
    def http_base_url(self) -> str:
        """Base URL of the router's OpenAI-compatible API (what an OpenAI SDK takes as base_url):
        HTTPS on a secured mesh, whose public port has TLS."""
        scheme = "https" if self.spec.secure else "http"
        return f"{scheme}://127.0.0.1:{self.router_http_port}/v1"

    def workers(self) -> list[ServiceProcess]:
        return [s for s in self.services if s.name.startswith("worker-")]

    # -- state ------------------------------------------------------------------------------

    def save_state(self) -> None:
        with self._lock:
            self._save_state()

    def _save_state(self) -> None:
        entries = []
        for server in (part for infra in self.infra for part in infra.parts()):
            if server.process is not None and server.pid is not None:
                entries.append(
                    {
                        "name": server.name,
                        "pid": server.pid,
                        "argv0": server.process.argv[0],
                        "address": server.address,
                        "log": str(server.log_path),
                    }
                )
        for service in self.services:
            if service.pid is not None:
                entries.append(
                    {
                        "name": service.name,
                        "pid": service.pid,
                        "argv0": service.process.argv[0],
                        "address": service.address,
                        "metrics_port": service.metrics_port,
                        "log": str(service.process.log_path),
                    }
                )
        # Atomic: `ballast down` and `status` may read it while a supervisor rewrites it.
        path = self.state_dir / STATE_FILE
        tmp = path.with_name(f".{STATE_FILE}.tmp")
        tmp.write_text(
            json.dumps(
                {
                    "config": str(self.config_path),
                    "router": self.router_address,
                    "model": self.spec.model_name,
                    "http": self.http_base_url,
                    **self.extra_state,
                    "processes": entries,
                },
                indent=2,
            )
        )
        os.replace(tmp, path)

    def stop(self) -> None:
        """Stops services (workers first: they drain), then the router, then infra."""
        order = self.workers() + [s for s in self.services if not s.name.startswith("worker-")][::-1]
        for service in order:
            service.process.stop(timeout=30.0)
        for server in reversed(self.infra):
            server.stop()
        state = self.state_dir / STATE_FILE
        if state.exists():
            state.unlink()


def wait_for_workers(config_path: Path, count: int, timeout: float) -> None:
    """Blocks until `count` workers hold a lease in the etcd that `config_path` names."""
    import asyncio

    from services.cli.etcd_view import list_workers
    from services.config import load_config

    config = load_config(config_path, environ={})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(asyncio.run(list_workers(config.etcd))) >= count:
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise ProcessStartError(f"fewer than {count} workers registered in etcd after {timeout:.0f}s")


def read_state(state_dir: Path) -> dict | None:
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def running_state(state_dir: Path) -> dict | None:
    """The recorded mesh, if its supervisor (or, without one, its router) is still running."""
    state = read_state(state_dir)
    if state is None:
        return None
    supervisor = state.get("supervisor")
    if supervisor is not None:
        return state if pid_alive(supervisor["pid"]) else None
    router = next((p for p in state["processes"] if p["name"] == "router"), None)
    if router is None or not pid_alive(router["pid"]):
        return None
    return state


def stop_recorded(
    state_dir: Path, timeout: float = 30.0, supervisor_timeout: float = 180.0
) -> list[tuple[str, int, str]]:
    """Stops the mesh recorded in mesh.json. A supervisor, when one runs it, is asked first
    (SIGTERM: it stops every process it runs, restarted ones included, in reverse start
    order); then every recorded process still running is stopped by PID, newest first
    (workers, services, infra): all of them when the supervisor is gone."""
    state = read_state(state_dir)
    if state is None:
        return []
    results = []
    entries = list(reversed(state["processes"]))
    supervisor = state.get("supervisor")
    if supervisor is not None:
        outcome = stop_pid(supervisor["pid"], supervisor["argv0"], timeout=supervisor_timeout)
        results.append(("supervisor", supervisor["pid"], outcome.value))
        # It rewrote mesh.json while it ran (the PIDs of the processes it restarted) and as it
        # stopped them (dropping each stopped one): the latest PID of each name.
        latest = {e["name"]: e for e in (read_state(state_dir) or state)["processes"]}
        entries = [latest.get(e["name"], e) for e in entries]
    for entry in entries:
        outcome = stop_pid(entry["pid"], entry["argv0"], timeout=timeout)
        if supervisor is not None and outcome is StopOutcome.NOT_RUNNING and results[0][2] == "stopped":
            results.append((entry["name"], entry["pid"], "stopped by the supervisor"))
        else:
            results.append((entry["name"], entry["pid"], outcome.value))
    (Path(state_dir) / STATE_FILE).unlink(missing_ok=True)
    return results
