"""`process_running`: a live process, not one gone, reaped or a zombie (read from /proc)."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.hostile_poison import process_running


def test_this_process_runs_and_no_pid_does_not():
    assert process_running(os.getpid())
    assert not process_running(None)


def test_a_child_that_exited_is_not_running_as_a_zombie_nor_once_reaped():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Exited, not yet reaped: a zombie. os.waitid with WNOWAIT waits without reaping it.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    assert not process_running(child.pid)
    child.wait()
    assert not process_running(child.pid)
