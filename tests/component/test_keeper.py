"""The worker keeper: respawns a worker after any death once one was ready (a fresh one killed
while it loads, a crash loop, a worker over its memory limit), with a doubling backoff; gives up
on a first worker that dies before it is ready and on a clean exit; passes SIGTERM on. Each
keeper runs in a subprocess of its own (it forks and installs signal handlers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.worker.keeper import CrashLoop, RespawnPolicy, exit_code

ROOT = Path(__file__).resolve().parents[2]

# Each child appends one line to the runs file, then acts out what the mode says for that run.
SCRIPT = textwrap.dedent("""
    import logging, os, signal, subprocess, sys, time
    logging.basicConfig(level=logging.INFO)
    from services.common.backoff import BackoffPolicy
    from services.worker.keeper import Keeper, RespawnPolicy
    mode, runs, max_crashes, memory_limit_mb = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    def serve(ready):
        with open(runs, "a") as f:
            f.write(f"{os.getpid()}\\n")
        n = len(open(runs).read().split())
        if mode == "die-before-ready":
            return 3
        if mode == "killed-while-restarting":
            # Serves, is killed; the fresh one is killed while it loads; the third serves.
            if n == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            ready()
            if n == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return 0
        if mode != "with-engine":
            ready()
        if mode == "killed-then-clean" and n < 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "crash-loop":
            return 1 if n < 5 else 0
        if mode == "grow-on-command":
            if n == 1:
                # Grows past its memory limit when the test says so (a schema bomb, say).
                while not os.path.exists(runs + ".grow"):
                    time.sleep(0.02)
                hog = bytearray(300 * 1024 * 1024)
                for i in range(0, len(hog), 4096):
                    hog[i] = 1  # touched: resident, not just reserved
                time.sleep(60)
            return 0
        if mode == "with-engine":
            # Like vLLM's engine process: started by the worker, ended by nobody but the keeper.
            engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            with open(runs + ".engines", "a") as f:
                f.write(f"{engine.pid}\\n")
            ready()
            if n < 2:
                os.kill(os.getpid(), signal.SIGKILL)
        if mode in ("wait-for-term", "with-engine"):
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            print("serving", flush=True)
            # Short sleeps: a handler runs between bytecodes, so a SIGTERM that lands just
            # before one long sleep would wait out the sleep (a worker serves from an event
            # loop, whose signal handlers wake it at once).
            for _ in range(600):
                time.sleep(0.1)
            return 5
        return 0

    backoff = BackoffPolicy(initial_s=0.05, max_s=0.2)
    sys.exit(Keeper(serve, RespawnPolicy(max_crashes, 60.0, backoff, memory_limit_mb)).run())
""")


def run_keeper(
    tmp_path: Path, mode: str, max_crashes: int = 10, memory_limit_mb: int = 0, **kwargs
) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'protos'}"}
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode, str(tmp_path / "runs"), str(max_crashes), str(memory_limit_mb)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def runs(tmp_path: Path) -> list[str]:
    return (tmp_path / "runs").read_text().split()


def test_a_worker_killed_after_it_was_ready_is_started_again(tmp_path):
    keeper = run_keeper(tmp_path, "killed-then-clean")
    output, _ = keeper.communicate(timeout=60)
    assert keeper.returncode == 0, output
    assert len(runs(tmp_path)) == 3  # killed twice, the third exits cleanly
    assert len(set(runs(tmp_path))) == 3
    assert output.count("killed by SIGKILL; starting a fresh one") == 2


def test_a_worker_that_dies_before_it_is_ready_ends_the_keeper_with_its_status(tmp_path):
    keeper = run_keeper(tmp_path, "die-before-ready")
    output, _ = keeper.communicate(timeout=60)
    assert keeper.returncode == 3
    assert len(runs(tmp_path)) == 1
    assert "before it was ready" in output


def test_a_fresh_worker_killed_before_it_is_ready_is_started_again(tmp_path):
    # The first worker served, so the settings start: a fresh one killed while it loads (a
    # host that fails twice in a row) is a crash, not a start-up failure to give up on.
    keeper = run_keeper(tmp_path, "killed-while-restarting")
    output, _ = keeper.communicate(timeout=60)
    assert keeper.returncode == 0, output
    assert len(runs(tmp_path)) == 3
    assert "killed by SIGKILL before it was ready; starting a fresh one" in output


def test_a_crash_loop_is_reported_and_the_keeper_goes_on_with_a_doubling_backoff(tmp_path):
    keeper = run_keeper(tmp_path, "crash-loop", max_crashes=2)
    output, _ = keeper.communicate(timeout=60)
    assert keeper.returncode == 0, output  # the fifth worker exits cleanly
    assert len(runs(tmp_path)) == 5
    # More than two crashes in the window: reported twice (the third and the fourth).
    assert output.count("crash loop: more than 2 worker deaths") == 2
    waits = [line.split(" in ")[-1].split(" s ")[0] for line in output.splitlines() if "starting a fresh one" in line]
    assert waits == ["0.1", "0.1", "0.2", "0.2"]  # 0.05 (printed 0.1), 0.1, 0.2, then the cap


def test_a_worker_over_its_memory_limit_is_killed_and_started_again(tmp_path):
    keeper = run_keeper(tmp_path, "grow-on-command", memory_limit_mb=150)
    deadline = time.monotonic() + 30
    while not (tmp_path / "runs").exists():
        assert time.monotonic() < deadline, "the worker never ran"
        time.sleep(0.02)
    (tmp_path / "runs.grow").touch()  # the command to grow past the limit
    output, _ = keeper.communicate(timeout=60)
    assert keeper.returncode == 0, output  # the second worker exits cleanly
    assert len(runs(tmp_path)) == 2
    assert "killed by SIGKILL (memory limit (" in output
    assert "over 150 MB)); starting a fresh one" in output


def test_sigterm_reaches_the_worker_and_the_keeper_exits_with_its_status(tmp_path):
    keeper = run_keeper(tmp_path, "wait-for-term")
    assert "serving" in keeper.stdout.readline()
    keeper.send_signal(signal.SIGTERM)
    output, _ = keeper.communicate(timeout=30)
    assert keeper.returncode == 0, output  # the worker's own clean exit, not the keeper killed
    assert len(runs(tmp_path)) == 1
    assert "after the stop signal" in output


def test_killing_the_keeper_takes_its_worker_with_it(tmp_path):
    keeper = run_keeper(tmp_path, "wait-for-term")
    assert "serving" in keeper.stdout.readline()
    worker = int(runs(tmp_path)[0])
    os.kill(keeper.pid, signal.SIGKILL)
    keeper.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)


def test_what_a_dead_worker_left_in_its_group_is_ended(tmp_path):
    """vLLM's engine process outlives a worker killed by SIGKILL, and one that exits on
    SIGTERM without stopping it: the keeper ends it both times."""
    keeper = run_keeper(tmp_path, "with-engine")
    assert "killed by SIGKILL; starting a fresh one" in keeper.stdout.readline()
    assert "serving" in keeper.stdout.readline()  # the second worker
    engines = [int(pid) for pid in (tmp_path / "runs.engines").read_text().split()]
    assert len(engines) == 2
    _until_gone(engines[0])
    assert _alive(engines[1])
    keeper.send_signal(signal.SIGTERM)
    output, _ = keeper.communicate(timeout=30)
    assert keeper.returncode == 0, output
    _until_gone(engines[1])


def _until_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"process {pid} outlived its worker"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("crashes, window_ok", [(2, True), (3, False)])
def test_crash_loop_counts_crashes_within_the_window(crashes, window_ok):
    now = [0.0]
    loop = CrashLoop(RespawnPolicy(max_crashes=2, window_s=10.0), clock=lambda: now[0])
    results = []
    for _ in range(crashes):
        results.append(loop.crashed())
        now[0] += 1.0
    assert results[-1] is (not window_ok)


def test_crashes_older_than_the_window_are_forgotten():
    now = [0.0]
    loop = CrashLoop(RespawnPolicy(max_crashes=1, window_s=10.0), clock=lambda: now[0])
    assert not loop.crashed()
    now[0] = 11.0
    assert not loop.crashed()
    now[0] = 12.0
    assert loop.crashed()


def test_exit_code_reads_like_a_shell():
    assert exit_code(0) == 0
    assert exit_code(3 << 8) == 3
    assert exit_code(signal.SIGKILL) == 128 + signal.SIGKILL
