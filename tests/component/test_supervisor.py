"""The supervisor on real child processes: a child that dies is started again after a
doubling backoff and the state file says how it died; a child over its memory limit is
killed and started again; readiness comes from a grpc.health.v1 Check; stop() stops the
children in reverse start order. Faults are aimed by each child's own state (a command
file it waits for), never by elapsed time."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.processes import free_port
from services.supervisor import ChildSpec, GrpcHealthProbe, RestartPolicy, Supervisor, read_state

FAST = RestartPolicy(initial_s=0.05, max_s=0.2, reset_after_s=60.0)

# Each run appends its pid to RUNS; what it does then depends on the mode.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    mode, runs, name = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(runs, "a") as f:
        f.write(f"{os.getpid()}\\n")
    n = len(open(runs).read().split())
    if mode == "exit-3-twice" and n <= 2:
        sys.exit(3)
    if mode == "always-exit-1":
        sys.exit(1)
    if mode == "log-stop":
        def stop(*_):
            with open(os.environ["STOPS"], "a") as f:
                f.write(name + "\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        open(runs + ".ready", "w").close()
    if mode == "grow-on-command":
        open(runs + f".ready{n}", "w").close()
        while not os.path.exists(runs + ".grow") or n > 1:
            time.sleep(0.02)
        hog = bytearray(300 * 1024 * 1024)
        for i in range(0, len(hog), 4096):
            hog[i] = 1  # touched: resident, not just reserved
    while True:
        time.sleep(1)
""")

HEALTH_SERVER = textwrap.dedent("""
    import os, sys, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    port, go = sys.argv[1], sys.argv[2]
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    while not os.path.exists(go):
        time.sleep(0.02)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.wait_for_termination()
""")


def child(tmp_path: Path, name: str, mode: str, **kwargs) -> ChildSpec:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return ChildSpec(
        name,
        [sys.executable, str(script), mode, str(tmp_path / f"{name}.runs"), name],
        tmp_path / f"{name}.log",
        policy=kwargs.pop("policy", FAST),
        stop_grace_s=5.0,
        **kwargs,
    )


def runs(tmp_path: Path, name: str) -> list[int]:
    path = tmp_path / f"{name}.runs"
    return [int(pid) for pid in path.read_text().split()] if path.exists() else []


def tick_until(supervisor: Supervisor, done, what: str, timeout_s: float = 30.0) -> None:
    """Ticks the supervisor until done() holds (the bound only keeps a broken test from hanging)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        supervisor.tick()
        time.sleep(0.01)


def entry(state: dict, name: str) -> dict:
    return next(c for c in state["children"] if c["name"] == name)


def test_a_child_that_exits_is_started_again_and_the_state_file_says_why(tmp_path):
    state_path = tmp_path / "state" / "supervisor.json"
    supervisor = Supervisor([child(tmp_path, "flaky", "exit-3-twice")], state_path)
    try:
        supervisor.start()
        tick_until(
            supervisor,
            lambda: len(runs(tmp_path, "flaky")) == 3 and supervisor.child("flaky").status == "up",
            "the third run",
        )
        state = read_state(state_path)
        flaky = entry(state, "flaky")
        assert flaky["restarts"] == 2
        assert flaky["status"] == "up"
        assert flaky["pid"] == runs(tmp_path, "flaky")[-1]
        assert flaky["last_exit"]["code"] == 3 and flaky["last_exit"]["signal"] is None
        assert flaky["last_exit"]["text"] == "exited with status 3"
        assert flaky["backoff_s"] == pytest.approx(0.1)  # the second death in a row waited twice the first
        assert not flaky["last_exit"]["oom_killed"]
    finally:
        supervisor.stop()
    assert entry(read_state(state_path), "flaky")["status"] == "stopped"


def test_a_child_that_keeps_dying_waits_longer_each_time_up_to_the_cap(tmp_path):
    waits: list[float] = []

    def record(state: dict) -> None:
        looping = entry(state, "looping")
        if looping["status"] == "backoff" and (not waits or looping["restarts"] + 1 > len(waits)):
            waits.append(looping["backoff_s"])

    supervisor = Supervisor([child(tmp_path, "looping", "always-exit-1")], on_change=record)
    supervisor.start()
    try:
        tick_until(supervisor, lambda: len(waits) >= 5, "five deaths")
    finally:
        supervisor.stop()
    assert waits[:5] == pytest.approx([0.05, 0.1, 0.2, 0.2, 0.2])
    assert supervisor.child("looping").backoff.at_cap


def test_a_killed_child_is_started_again_with_its_signal_recorded(tmp_path):
    import os
    import signal

    supervisor = Supervisor([child(tmp_path, "victim", "sleep")], tmp_path / "s.json")
    supervisor.start()
    try:
        first = supervisor.pid("victim")
        os.kill(first, signal.SIGKILL)
        tick_until(
            supervisor,
            lambda: supervisor.child("victim").restarts == 1 and supervisor.child("victim").status == "up",
            "the restart",
        )
        assert supervisor.pid("victim") not in (None, first)
        last = entry(read_state(tmp_path / "s.json"), "victim")["last_exit"]
        assert last["signal"] == "SIGKILL" and last["code"] is None
    finally:
        supervisor.stop()


def test_a_child_over_its_memory_limit_is_killed_alone_and_started_again(tmp_path):
    bystander = child(tmp_path, "bystander", "sleep")
    hog = child(tmp_path, "hog", "grow-on-command", memory_limit_mb=150)
    supervisor = Supervisor([bystander, hog], tmp_path / "s.json")
    supervisor.start()
    try:
        bystander_pid = supervisor.pid("bystander")
        tick_until(supervisor, lambda: (tmp_path / "hog.runs.ready1").exists(), "the hog to run")
        (tmp_path / "hog.runs.grow").touch()  # the command to grow past the limit
        tick_until(
            supervisor,
            lambda: supervisor.child("hog").restarts == 1 and supervisor.child("hog").status == "up",
            "the hog's restart",
        )
        last = entry(read_state(tmp_path / "s.json"), "hog")["last_exit"]
        assert last["signal"] == "SIGKILL"
        assert last["cause"] == "memory limit" and last["oom_killed"]
        assert "over 150 MB" in last["detail"]
        assert supervisor.pid("bystander") == bystander_pid  # it died alone
        assert supervisor.child("bystander").restarts == 0
    finally:
        supervisor.stop()


def test_stop_stops_the_children_in_reverse_start_order(tmp_path):
    names = ["first", "second", "third"]
    stops = tmp_path / "stops"
    specs = [
        child(
            tmp_path,
            name,
            "log-stop",
            stage=stage,
            env={"STOPS": str(stops)},
            ready=lambda name=name: (tmp_path / f"{name}.runs.ready").exists(),
        )
        for name, stage in zip(names, (0, 1, 1))
    ]
    supervisor = Supervisor(specs, tmp_path / "s.json")
    supervisor.start()
    pids = [supervisor.pid(n) for n in names]
    supervisor.stop()
    # Each child wrote its name on SIGTERM (the supervisor waits for one to end before the next).
    assert stops.read_text().split() == ["third", "second", "first"]
    assert all(_zombie(pid) for pid in pids)
    assert [c["status"] for c in read_state(tmp_path / "s.json")["children"]] == ["stopped"] * 3


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_readiness_comes_from_the_grpc_health_check(tmp_path):
    script = tmp_path / "health_server.py"
    script.write_text(HEALTH_SERVER)
    port = free_port()
    go = tmp_path / "go"
    spec = ChildSpec(
        "server",
        [sys.executable, str(script), str(port), str(go)],
        tmp_path / "server.log",
        ready=GrpcHealthProbe(f"127.0.0.1:{port}"),
        start_timeout_s=60.0,
    )
    supervisor = Supervisor([spec], tmp_path / "s.json")
    starting = threading.Thread(target=supervisor.start)
    starting.start()
    try:
        # The server answers, NOT_SERVING: the supervisor must still be waiting.
        assert _health(port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert starting.is_alive()
        assert entry(read_state(tmp_path / "s.json"), "server")["status"] == "starting"
        go.touch()
        starting.join(timeout=60)
        assert not starting.is_alive()
        assert supervisor.child("server").status == "up"
        assert _health(port) == health_pb2.HealthCheckResponse.SERVING
    finally:
        go.touch()
        starting.join(timeout=60)
        supervisor.stop()


def _health(port: int) -> int:
    deadline = time.monotonic() + 30
    while True:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the health server never answered"
                time.sleep(0.05)


def test_a_child_that_dies_during_the_first_start_fails_it_and_stops_the_rest(tmp_path):
    from services.common.processes import ProcessStartError

    steady = child(tmp_path, "steady", "sleep")
    broken = child(tmp_path, "broken", "always-exit-1", stage=1, ready=lambda: False)
    supervisor = Supervisor([steady, broken], tmp_path / "s.json")
    with pytest.raises(ProcessStartError, match="broken"):
        supervisor.start()
    state = read_state(tmp_path / "s.json")
    assert state["phase"] == "failed"
    assert [c["status"] for c in state["children"]] == ["stopped", "stopped"]
    assert _zombie(runs(tmp_path, "steady")[0]) or not Path(f"/proc/{runs(tmp_path, 'steady')[0]}").exists()


def test_child_names_must_be_unique(tmp_path):
    with pytest.raises(ValueError, match="unique"):
        Supervisor([child(tmp_path, "a", "sleep"), child(tmp_path, "a", "sleep")])
