"""Managed child processes: start a server in its own process group, stop it and all it spawned.

Used by the local-server launchers (etcd, Redis, the Kafka broker) and by the CLI's `up`/`down`
commands. Every child runs in a new session, so a stop signals the whole process group and
no grandchild (a shell wrapper's real server, a helper it forked) outlives it.

Also holds the small port helpers those launchers need: pick a free loopback port, wait for a
port to accept connections, wait for it to be released after a stop.
"""

from __future__ import annotations

import enum
import errno
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = [
    "ManagedProcess",
    "ProcessStartError",
    "StopOutcome",
    "free_port",
    "free_ports",
    "port_is_open",
    "port_is_free",
    "wait_port_open",
    "wait_port_free",
    "wait_until_ready",
    "stop_pid",
    "read_log_tail",
]

_POLL_S = 0.02


class ProcessStartError(RuntimeError):
    """A child process died, or never became ready, while it was being started."""

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        full = message if not log_tail else f"{message}\n--- last log lines ---\n{log_tail}"
        super().__init__(full)
        self.log_tail = log_tail


def read_log_tail(path: Path | str, lines: int = 20, max_bytes: int = 64 * 1024) -> str:
    """Return the last `lines` lines of a log file (empty if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


class ManagedProcess:
    """One child process, run as the leader of its own process group, output to a log file.

    `env` is laid over the current environment (not a replacement for it). The log file is
    opened for append, so a restart keeps the earlier run's lines above the new ones.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path | str,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> None:
        if not argv:
            raise ValueError("argv must not be empty")
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.env = dict(env) if env else {}
        self.cwd = Path(cwd) if cwd is not None else None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> ManagedProcess:
        """Launch the child. Raises if it is already running."""
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env} if self.env else None
        with open(self.log_path, "ab") as log:
            try:
                self._proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.cwd,
                    close_fds=True,
                    # Its own session, hence its own process group (pgid == pid): stop() can
                    # signal everything the child spawns, and a Ctrl-C in our terminal does
                    # not reach it behind our back.
                    start_new_session=True,
                )
            except OSError as e:
                raise ProcessStartError(f"{self.name}: cannot execute {self.argv[0]!r}: {e}") from e
        # The child holds its own copy of the log descriptor; ours closes with the `with`.
        return self

    @property
    def pid(self) -> int | None:
        """The child's PID (also its process-group id), or None if never started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """Exit status once the child has been reaped (negative: killed by that signal)."""
        return self._proc.returncode if self._proc is not None else None

    def _exited(self) -> bool:
        """True once the child has exited, without reaping it.

        Not reaping matters: while the leader is an unreaped zombie its PID, and so its
        process-group id, cannot be reused, which keeps a later killpg() aimed at our group.
        """
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            # Reaped behind our back (someone called wait on it); treat as gone.
            proc.poll()
            return True
        return info is not None

    def alive(self) -> bool:
        """True while the child is running (an exited, unreaped child counts as dead)."""
        return not self._exited()

    def exit_status(self) -> int | None:
        """The exit status if the child has exited (reaping it), else None."""
        if self._proc is None:
            return None
        if self._exited():
            # Sweep any group members left behind before the reap frees the group id.
            self._signal_group(signal.SIGKILL)
            return self._proc.wait()
        return None

    def _signal_group(self, sig: int) -> None:
        if self._proc is None or self._proc.returncode is not None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the process group, wait up to `timeout`, then SIGKILL the group; reap.

        Idempotent: stopping a stopped (or never started) process returns its status.
        Stragglers in the group (a grandchild that ignored SIGTERM) are SIGKILLed even when
        the leader exited in time, so nothing the child spawned outlives the stop.
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is not None:
            return proc.returncode
        if not self._exited():
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + max(0.0, timeout)
            while not self._exited() and time.monotonic() < deadline:
                time.sleep(_POLL_S)
        self._signal_group(signal.SIGKILL)
        return proc.wait()

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once and reap the leader."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is not None:
            return proc.returncode
        self._signal_group(signal.SIGKILL)
        return proc.wait()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to exit on its own and reap it (TimeoutExpired on timeout)."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self._proc.wait(timeout)

    # -- diagnostics -----------------------------------------------------------------------

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the child's log file."""
        return read_log_tail(self.log_path, lines)

    def ensure_alive(self, during: str = "startup") -> None:
        """Raise ProcessStartError, with the log's last lines, if the child has exited."""
        if self._proc is None:
            raise ProcessStartError(f"{self.name} was never started")
        if self._exited():
            rc = self.exit_status()
            raise ProcessStartError(
                f"{self.name} (pid {self._proc.pid}) exited with status {rc} during {during}; log: {self.log_path}",
                log_tail=self.log_tail(),
            )

    def __repr__(self) -> str:
        state = "running" if self._proc is not None and self.alive() else "stopped"
        return f"ManagedProcess({self.name!r}, pid={self.pid}, {state})"


# -- readiness ---------------------------------------------------------------------------------


def wait_until_ready(
    process: ManagedProcess,
    probe: Callable[[], bool],
    timeout: float,
    *,
    interval: float = 0.05,
    what: str = "ready",
) -> float:
    """Call `probe` until it returns True; return the seconds that took.

    Raises ProcessStartError (with the log's last lines) as soon as the process dies, or when
    `timeout` passes; the process is left as it is, so the caller decides whether to stop it.
    A probe may raise: that counts as "not yet".
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    last_error: BaseException | None = None
    while True:
        process.ensure_alive()
        try:
            if probe():
                return time.monotonic() - t0
        except Exception as e:  # a probe failing just means "not yet"
            last_error = e
        if time.monotonic() >= deadline:
            detail = f" (last probe error: {last_error!r})" if last_error else ""
            raise ProcessStartError(
                f"{process.name} (pid {process.pid}) was not {what} after {timeout:.1f}s{detail}; "
                f"log: {process.log_path}",
                log_tail=process.log_tail(),
            )
        time.sleep(interval)


# -- ports -------------------------------------------------------------------------------------


# Listening ports are picked below the kernel's ephemeral range: every outgoing connection
# (to etcd, Redis, a peer) takes its local port from that range, and one that lands on a port
# picked for a server a moment earlier makes that server's bind fail (address in use).
LISTEN_PORTS_FLOOR = 20000
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_floor() -> int | None:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class _HandedOut:
    """Ports this process handed out lately, never handed out again while remembered.

    A port is picked long before its server binds it: a mesh picks etcd's, Redis's, the
    broker's and the router's ports one after another and only then starts them, and a
    server restarted after a fault binds its old port again. Without this memory a later pick
    could return a port an earlier pick gave to a server not listening yet, and whichever of
    the two bound second would fail with "address in use".
    """

    def __init__(self, remember: int) -> None:
        self._order: deque[int] = deque()
        self._ports: set[int] = set()
        self._remember = remember
        self._lock = threading.Lock()

    def __contains__(self, port: int) -> bool:
        with self._lock:
            return port in self._ports

    def add(self, ports: list[int]) -> None:
        with self._lock:
            for port in ports:
                if port in self._ports:
                    continue
                self._order.append(port)
                self._ports.add(port)
            while len(self._order) > self._remember:
                self._ports.discard(self._order.popleft())


# A quarter of the range below the usual ephemeral floor (32768): a test session or a
# benchmark picks a few hundred ports at most.
_HANDED_OUT = _HandedOut(remember=3000)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host` right now, below the ephemeral range where the
    kernel says what it is (else whatever port 0 gives), and none this process handed out
    lately (see _HandedOut).

    All sockets stay bound until every port is picked, so the ports differ from each other.
    Another process can still take one before it is used: start servers soon after.
    """
    ceiling = _ephemeral_floor()
    rng = random.SystemRandom()
    below_ephemeral = ceiling is not None and ceiling > LISTEN_PORTS_FLOOR + 100 * count
    socks: list[socket.socket] = []
    misses = 0
    try:
        while len(socks) < count:
            # After many taken ports in a row, port 0 (which raises if nothing is free).
            port = rng.randrange(LISTEN_PORTS_FLOOR, ceiling) if below_ephemeral and misses < 100 else 0
            if port in _HANDED_OUT:
                misses += 1
                continue
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                if port == 0:
                    raise
                misses += 1
                continue
            socks.append(s)
        ports = [s.getsockname()[1] for s in socks]
        _HANDED_OUT.add(ports)
        return ports
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on `host` right now (see free_ports)."""
    return free_ports(1, host)[0]


def port_is_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True if something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_is_free(host: str, port: int) -> bool:
    """True if a server could bind host:port now.

    The probe sets SO_REUSEADDR, as etcd, Redis and Tansu do, so connections left in
    TIME_WAIT by the previous server do not count as "in use": only a live listener does.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        return True
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            return False
        raise
    finally:
        s.close()


def wait_port_open(
    host: str,
    port: int,
    timeout: float,
    *,
    process: ManagedProcess | None = None,
) -> float:
    """Wait until host:port accepts connections; return the seconds waited.

    With `process`, fail fast (ProcessStartError with its log tail) if it dies meanwhile.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        if process is not None:
            process.ensure_alive()
        if port_is_open(host, port, timeout=0.25):
            return time.monotonic() - t0
        if time.monotonic() >= deadline:
            msg = f"{host}:{port} did not open within {timeout:.1f}s"
            if process is not None:
                raise ProcessStartError(f"{process.name}: {msg}", log_tail=process.log_tail())
            raise TimeoutError(msg)
        time.sleep(_POLL_S * 2)


def wait_port_free(host: str, port: int, timeout: float) -> float:
    """Wait until host:port can be bound again; return the seconds waited.

    Needed before restarting a server on the same port: Tansu in particular keeps its
    listener for a second or two after SIGTERM and fails with AddrInUse if started early.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    while not port_is_free(host, port):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{host}:{port} still in use after {timeout:.1f}s")
        time.sleep(_POLL_S * 2)
    return time.monotonic() - t0


# -- stopping a process we did not spawn in this interpreter ----------------------------------


class StopOutcome(str, enum.Enum):
    """What stop_pid found and did."""

    STOPPED = "stopped"  # it was ours and running; it is gone now
    NOT_RUNNING = "not_running"  # no such process (or only a zombie): stale PID file
    MISMATCH = "mismatch"  # the PID now belongs to something else; left alone


def _proc_cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return [p.decode("utf-8", errors="replace") for p in raw.split(b"\0") if p]


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name is in parentheses and may itself contain spaces or ')'.
    return stat.rsplit(")", 1)[1].split()[0]


def _proc_gone(pid: int) -> bool:
    state = _proc_state(pid)
    return state is None or state in ("Z", "X")


def _cmdline_matches(cmdline: list[str], argv0: str) -> bool:
    want = os.path.basename(argv0)
    if not cmdline or not want:
        return False
    if os.path.basename(cmdline[0]) == want:
        return True
    # Redis and Valkey rewrite their process title to "<binary> <host>:<port>" in one string.
    if os.path.basename(cmdline[0].split(" ", 1)[0]) == want:
        return True
    # A console-script wrapper (the venv's `etcd` is one) shows up as `python3 /path/etcd ...`
    # until it execs the real binary.
    return (
        len(cmdline) > 1 and os.path.basename(cmdline[0]).startswith("python") and os.path.basename(cmdline[1]) == want
    )


def _identity_ok(pid: int, argv0: str) -> bool | None:
    """True: ours; False: someone else's; None: gone."""
    if _proc_gone(pid):
        return None
    cmdline = _proc_cmdline(pid)
    if cmdline is None:
        return None
    if not _cmdline_matches(cmdline, argv0):
        return False
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        # Everything ManagedProcess starts leads its own group; anything else is not ours, and
        # signalling its group could hit unrelated processes.
        if os.getpgid(pid) != pid:
            return False
    except (FileNotFoundError, ProcessLookupError):
        return None
    return True


def _group_has_live_members(pgid: int) -> bool:
    """True while any non-zombie process is in process group `pgid`.

    While such a member exists the kernel keeps the number `pgid` reserved, so signalling the
    group cannot reach a newcomer that happens to reuse it.
    """
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # After the command name: state, ppid, pgrp, ...
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            return True
    return False


def stop_pid(pid: int, argv0: str, timeout: float = 10.0) -> StopOutcome:
    """Stop a process group recorded by an earlier run (e.g. from a PID file).

    Signals only if /proc/<pid> still shows a process owned by this user, leading its own
    process group, whose command's basename equals basename(`argv0`) (the recorded argv[0]);
    a PID reused by anything else is left alone (MISMATCH). SIGTERM to the group, wait up to
    `timeout` for every member to exit, then SIGKILL what is left of the group. The caller is
    not the parent, so it cannot reap: a zombie counts as stopped.
    """
    if pid <= 1 or pid == os.getpid() or pid == os.getpgid(0):
        return StopOutcome.MISMATCH
    ident = _identity_ok(pid, argv0)
    if ident is None:
        return StopOutcome.NOT_RUNNING
    if ident is False:
        return StopOutcome.MISMATCH
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return StopOutcome.NOT_RUNNING
    deadline = time.monotonic() + max(0.0, timeout)
    while _group_has_live_members(pid):
        if time.monotonic() >= deadline:
            # Members still exist, so the group id is still ours to signal.
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            kill_deadline = time.monotonic() + 5.0
            while _group_has_live_members(pid) and time.monotonic() < kill_deadline:
                time.sleep(_POLL_S)
            break
        time.sleep(_POLL_S * 2)
    return StopOutcome.STOPPED
