"""Where a soak phase's CPU time went: the engines, or everything around them.

On a machine without a GPU the engines compute on the same cores as every other process a
phase runs (routers, cache, backfill, etcd, Redis, the broker, the clients). `CpuMeter`
samples the CPU seconds of every process under the benchmark (it is their parent, or their
reaper) while the soak runs, sorts each process into a part by its command line, and adds up
what each part used in the soak's window, processes that died during it included (their last
sample). Read from /proc: Linux only, as the soak is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bench.soak.faults import process_tree

# The first match decides; checked against the command line (and the process name, which
# vLLM sets for its engine process).
PARTS = (
    # vLLM renames its processes (setproctitle): the scheduler "VLLM::EngineCore", the model
    # runner that computes the forward passes "VLLM::Worker", its server "VLLM::APIServer".
    ("EngineCore", "engine"),
    ("VLLM::Worker", "engine"),
    ("VLLM::APIServer", "server front"),
    ("vllm.entrypoints.openai.api_server", "server front"),
    ("bench.plain_server", "server front"),
    ("services.worker", "worker front"),
    ("services.router", "router"),
    ("services.cache", "cache"),
    ("services.backfill", "backfill"),
    ("etcd", "etcd"),
    ("redis", "redis"),
    ("valkey", "redis"),
    ("tansu", "kafka"),
    ("stunnel", "kafka"),
)
CLIENTS = "clients"
OTHER = "other"
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def part_of(command: str) -> str:
    """The part a process belongs to, from its name and command line."""
    for needle, part in PARTS:
        if needle in command:
            return part
    return OTHER


@dataclass
class _Seen:
    part: str
    first_s: float  # CPU seconds at the window's start (0 for a process born in it)
    last_s: float


def _read(pid: int) -> tuple[str, float, float] | None:
    """(name and command line, CPU seconds used, start time in seconds since boot)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    name, rest = stat.split("(", 1)[1].rsplit(")", 1)
    fields = rest.split()
    # After ")": state is field 3 of stat(5); utime and stime are 14 and 15, starttime 22.
    used = (int(fields[11]) + int(fields[12])) * _TICK_S
    return f"{name} {command}", used, int(fields[19]) * _TICK_S


def _uptime_s() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


class CpuMeter:
    """CPU seconds per part over a window, from samples of the process tree under `root`."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self._seen: dict[int, _Seen] = {}
        self._window_start_s = 0.0
        self._busy_start = 0.0
        self._busy_end = 0.0
        self._wall_start = 0.0
        self._wall_end = 0.0

    def start(self) -> None:
        self._seen.clear()
        self._window_start_s = _uptime_s()
        self._busy_start = self._busy_end = machine_busy_s()
        self._wall_start = self._wall_end = self._window_start_s
        self.sample()

    def sample(self) -> None:
        for pid in process_tree(self.root):
            read = _read(pid)
            if read is None:
                continue
            command, used, started_s = read
            seen = self._seen.get(pid)
            if seen is None:
                part = CLIENTS if pid == self.root else part_of(command)
                # Born inside the window: all its CPU time is the window's.
                first = 0.0 if started_s >= self._window_start_s else used
                self._seen[pid] = _Seen(part, first, used)
            else:
                seen.last_s = used
                if seen.part == OTHER:
                    # vLLM starts its engine processes as plain Python and names them later.
                    seen.part = part_of(command)
        self._busy_end = machine_busy_s()
        self._wall_end = _uptime_s()

    def by_part(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for seen in self._seen.values():
            totals[seen.part] = totals.get(seen.part, 0.0) + max(0.0, seen.last_s - seen.first_s)
        return {part: round(seconds, 1) for part, seconds in sorted(totals.items(), key=lambda kv: -kv[1])}

    def machine_busy_share(self) -> float:
        """Share of all cores' time that was busy over the window, whoever used it."""
        wall = self._wall_end - self._wall_start
        cores = os.cpu_count() or 1
        return (self._busy_end - self._busy_start) / (wall * cores) if wall > 0 else float("nan")


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) * _TICK_S
