"""Memory limits enforced from outside a process, and telling an OOM kill apart.

A process that grows without bound (a pathological request, a leak) must die alone, before
the kernel's OOM killer picks some other process on the host. The limit is checked from a
parent (the worker keeper, the local supervisor) because the process itself may be stuck in
native code holding its GIL: `tree_rss_bytes` sums the resident memory of a process and
everything it started (vLLM's engine process), and `MemoryWatch` polls it and SIGKILLs the
process group once it is over the limit.

RLIMIT_AS is no option (torch and vLLM reserve far more address space than they use), and a
cgroup v2 memory.max needs a writable cgroup, which a local mesh usually lacks.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

MB = 1024 * 1024
VMSTAT = Path("/proc/vmstat")


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants (0 when it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass  # ended between the listing and the read
    return total


def oom_kills() -> int | None:
    """The kernel's count of OOM kills since boot (None where /proc/vmstat lacks it): a rise
    across a SIGKILL nobody here sent says the kernel's OOM killer sent it."""
    try:
        for line in VMSTAT.read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def kill_group(pid: int) -> None:
    """SIGKILLs the process group led by `pid` (every child Ballast starts leads its own)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class MemoryWatch:
    """A thread that SIGKILLs a process group when its tree's RSS goes over `limit_bytes`.

    `exceeded` holds the RSS seen when it fired (None while it has not). Stop it (`stop()`)
    before the parent forks again: a fork copies only the forking thread.
    """

    def __init__(self, pid: int, limit_bytes: int, interval_s: float = 0.1) -> None:
        if limit_bytes <= 0:
            raise ValueError("limit_bytes must be positive")
        self.pid = pid
        self.limit_bytes = limit_bytes
        self.interval_s = interval_s
        self.exceeded: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"memory-watch-{pid}", daemon=True)

    def start(self) -> "MemoryWatch":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = tree_rss_bytes(self.pid)
            if rss > self.limit_bytes:
                self.exceeded = rss
                log.error(
                    "pid %d uses %d MB, over its limit of %d MB: killing it",
                    self.pid,
                    rss // MB,
                    self.limit_bytes // MB,
                )
                kill_group(self.pid)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def reason(self) -> str | None:
        """ "memory limit (N MB over M MB)" once it fired, else None."""
        if self.exceeded is None:
            return None
        return f"memory limit ({self.exceeded // MB} MB over {self.limit_bytes // MB} MB)"
