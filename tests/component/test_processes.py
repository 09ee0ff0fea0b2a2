"""Unit tests for the managed-process toolkit, using trivial children (sleep, python -c)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.common.processes import LISTEN_PORTS_FLOOR, _HandedOut
from services.common.processes import (
    ManagedProcess,
    ProcessStartError,
    StopOutcome,
    free_port,
    free_ports,
    port_is_free,
    port_is_open,
    stop_pid,
    wait_port_free,
    wait_port_open,
    wait_until_ready,
)

PY = sys.executable


def _gone(pid: int) -> bool:
    """Gone or a zombie: once a process is reparented, reaping it is not up to the test."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.02)
    return _gone(pid)


def _wait_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} never written")


@pytest.fixture
def procs():
    """Stops whatever a test started, even when it fails halfway."""
    started: list[ManagedProcess] = []
    yield started
    for p in started:
        p.kill()


def _spawn(procs, tmp_path: Path, name: str, argv: list[str], **kw) -> ManagedProcess:
    p = ManagedProcess(name, argv, log_path=tmp_path / f"{name}.log", **kw)
    procs.append(p)
    return p.start()


def test_start_stop_sleep(procs, tmp_path):
    p = _spawn(procs, tmp_path, "sleeper", ["sleep", "30"])
    assert p.pid and p.alive()
    # Its own process group, so stop() can signal everything under it.
    assert os.getpgid(p.pid) == p.pid
    assert p.stop(timeout=5) == -signal.SIGTERM
    assert not p.alive()
    assert _gone(p.pid)
    # Idempotent.
    assert p.stop() == -signal.SIGTERM
    assert p.kill() == -signal.SIGTERM


def test_never_started_is_harmless(tmp_path):
    p = ManagedProcess("idle", ["sleep", "1"], log_path=tmp_path / "idle.log")
    assert p.pid is None and not p.alive()
    assert p.stop() is None and p.kill() is None
    assert not (tmp_path / "idle.log").exists()


def test_output_env_and_cwd_go_where_asked(procs, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    code = textwrap.dedent("""
        import os, sys
        print("out:" + os.environ["BALLAST_TEST_VAR"], flush=True)
        print("err:" + os.getcwd(), file=sys.stderr, flush=True)
        print("path-kept:" + str(bool(os.environ.get("PATH"))), flush=True)
    """)
    p = _spawn(procs, tmp_path, "printer", [PY, "-c", code], env={"BALLAST_TEST_VAR": "hello"}, cwd=work)
    assert p.wait(timeout=10) == 0
    log = (tmp_path / "printer.log").read_text()
    assert "out:hello" in log
    assert f"err:{work}" in log
    assert "path-kept:True" in log


def test_restart_appends_to_log(procs, tmp_path):
    p = _spawn(procs, tmp_path, "twice", [PY, "-c", "print('run', flush=True)"])
    p.wait(timeout=10)
    p.start()
    p.wait(timeout=10)
    assert (tmp_path / "twice.log").read_text().count("run") == 2


def test_stop_escalates_to_sigkill(procs, tmp_path):
    ready = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").write("1")
        time.sleep(300)
    """)
    p = _spawn(procs, tmp_path, "stubborn", [PY, "-c", code])
    _wait_file(ready)
    t0 = time.monotonic()
    assert p.stop(timeout=0.3) == -signal.SIGKILL
    assert time.monotonic() - t0 < 3.0


def test_kill_is_sigkill(procs, tmp_path):
    p = _spawn(procs, tmp_path, "victim", ["sleep", "30"])
    assert p.kill() == -signal.SIGKILL
    assert not p.alive()


def _leader_with_grandchild(tmp_path: Path, grandchild_ignores_term: bool) -> tuple[list[str], Path]:
    pid_file = tmp_path / "grandchild.pid"
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if grandchild_ignores_term else ""
    grandchild = textwrap.dedent(f"""
        import os, signal, time
        {ignore}
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(300)
    """)
    leader = textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {grandchild!r}])
        time.sleep(300)
    """)
    return [PY, "-c", leader], pid_file


@pytest.mark.parametrize("ignores_term", [False, True], ids=["plain", "ignores-sigterm"])
def test_stop_takes_the_grandchild_too(procs, tmp_path, ignores_term):
    argv, pid_file = _leader_with_grandchild(tmp_path, ignores_term)
    p = _spawn(procs, tmp_path, "leader", argv)
    gpid = int(_wait_file(pid_file))
    assert os.getpgid(gpid) == p.pid
    p.stop(timeout=2)
    assert not p.alive()
    assert _wait_gone(gpid), "grandchild outlived its process group's stop"


def test_kill_takes_the_grandchild_too(procs, tmp_path):
    argv, pid_file = _leader_with_grandchild(tmp_path, grandchild_ignores_term=True)
    p = _spawn(procs, tmp_path, "leader", argv)
    gpid = int(_wait_file(pid_file))
    p.kill()
    assert _wait_gone(gpid)


def test_death_during_startup_reports_log_tail(procs, tmp_path):
    code = "import sys; print('boom: config is broken', flush=True); sys.exit(3)"
    p = _spawn(procs, tmp_path, "crasher", [PY, "-c", code])
    with pytest.raises(ProcessStartError) as info:
        wait_until_ready(p, lambda: False, timeout=10)
    msg = str(info.value)
    assert "crasher" in msg and "status 3" in msg
    assert "boom: config is broken" in msg
    assert "boom: config is broken" in info.value.log_tail


def test_readiness_timeout_reports_log_tail(procs, tmp_path):
    p = _spawn(
        procs, tmp_path, "slowpoke", [PY, "-c", "import time; print('still warming up', flush=True); time.sleep(30)"]
    )
    with pytest.raises(ProcessStartError) as info:
        wait_until_ready(p, lambda: 1 / 0, timeout=0.5)  # a raising probe means "not yet"
    assert "not ready after" in str(info.value)
    assert "ZeroDivisionError" in str(info.value)
    _wait_file(tmp_path / "slowpoke.log")
    assert p.alive()  # the caller decides what to do with it


def test_wait_until_ready_returns_elapsed(procs, tmp_path):
    p = _spawn(procs, tmp_path, "ok", ["sleep", "30"])
    calls = []

    def probe() -> bool:
        calls.append(1)
        return len(calls) >= 3

    # Two failed probes, each followed by a wait of `interval`, before the third succeeds.
    assert wait_until_ready(p, probe, timeout=5, interval=0.01) >= 0.02
    assert len(calls) == 3


def test_separate_picks_never_return_a_port_handed_out_before():
    # A mesh picks etcd's ports, then Redis's, then the router's, before any of them binds:
    # each pick must avoid the earlier ones. 1500 single picks from some 12,000 ports would
    # repeat one about 90 times if picks were independent.
    picked = [free_ports(1)[0] for _ in range(1500)]
    assert len(set(picked)) == len(picked)


def test_handed_out_ports_are_forgotten_oldest_first():
    handed_out = _HandedOut(remember=3)
    handed_out.add([1, 2])
    handed_out.add([2, 3, 4])  # 2 again is not a second entry
    assert 1 not in handed_out
    assert all(port in handed_out for port in (2, 3, 4))
    handed_out.add([5])
    assert 2 not in handed_out and 5 in handed_out


def test_port_helpers():
    a, b, c = free_ports(3)
    assert len({a, b, c}) == 3
    # Below the range outgoing connections take their local ports from: a client socket
    # cannot take a port picked for a server before the server binds it.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low > LISTEN_PORTS_FLOOR + 100 * 50:  # else there is no room below it: port 0 decides
        assert all(LISTEN_PORTS_FLOOR <= port < low for port in free_ports(50))
    port = free_port()
    assert port_is_free("127.0.0.1", port)
    assert not port_is_open("127.0.0.1", port)
    with pytest.raises(TimeoutError):
        wait_port_open("127.0.0.1", port, timeout=0.2)
    srv = socket.socket()
    srv.bind(("127.0.0.1", port))
    srv.listen()
    try:
        wait_port_open("127.0.0.1", port, timeout=2)
        assert port_is_open("127.0.0.1", port)
        assert not port_is_free("127.0.0.1", port)
        with pytest.raises(TimeoutError):
            wait_port_free("127.0.0.1", port, timeout=0.2)
    finally:
        srv.close()
    wait_port_free("127.0.0.1", port, timeout=2)
    assert port_is_free("127.0.0.1", port)


def test_wait_port_open_fails_fast_when_process_dies(procs, tmp_path):
    p = _spawn(procs, tmp_path, "noport", [PY, "-c", "print('no listener here', flush=True)"])
    t0 = time.monotonic()
    with pytest.raises(ProcessStartError, match="no listener here"):
        wait_port_open("127.0.0.1", free_port(), timeout=30, process=p)
    assert time.monotonic() - t0 < 10


def test_stop_pid_stops_a_matching_group(procs, tmp_path):
    argv, pid_file = _leader_with_grandchild(tmp_path, grandchild_ignores_term=True)
    p = _spawn(procs, tmp_path, "leader", argv)
    gpid = int(_wait_file(pid_file))
    # Recorded argv[0] is the interpreter path; /proc shows the same basename.
    assert stop_pid(p.pid, argv[0], timeout=0.5) == StopOutcome.STOPPED
    assert _wait_gone(p.pid) and _wait_gone(gpid)
    # We are the parent here, so the leader waits as a zombie until reaped.
    assert p.stop() == -signal.SIGTERM


def test_stop_pid_refuses_a_cmdline_mismatch(procs, tmp_path):
    p = _spawn(procs, tmp_path, "sleeper", ["sleep", "30"])
    assert stop_pid(p.pid, "/usr/bin/etcd", timeout=1) == StopOutcome.MISMATCH
    time.sleep(0.1)
    assert p.alive(), "stop_pid signalled a process whose cmdline did not match"


def test_stop_pid_refuses_a_process_not_leading_its_group(tmp_path):
    # Same command, but in our own process group: signalling "its group" would hit us.
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert stop_pid(child.pid, "sleep", timeout=1) == StopOutcome.MISMATCH
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_stop_pid_on_a_stale_pid(procs, tmp_path):
    p = _spawn(procs, tmp_path, "brief", ["sleep", "30"])
    pid = p.pid
    p.stop()
    assert stop_pid(pid, "sleep", timeout=1) == StopOutcome.NOT_RUNNING
    assert stop_pid(os.getpid(), PY) == StopOutcome.MISMATCH


def test_cmdline_match_accepts_a_rewritten_process_title():
    from services.common.processes import _cmdline_matches

    # Redis/Valkey set their title to "<binary> <host>:<port>" as one string.
    assert _cmdline_matches(["/venv/bin/valkey-server 127.0.0.1:6379"], "/venv/bin/valkey-server")
    assert not _cmdline_matches(["/usr/bin/other-server 127.0.0.1:6379"], "/venv/bin/valkey-server")
