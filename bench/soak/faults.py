"""The soak's chaos: when each fault strikes, how a process is frozen or slowed, and when the
load has settled after the surge.

The schedule is data (seeded, the same for both phases): each fault at a fraction of the
soak, jittered, with how long it is held. A phase applies the kinds it has a part for: the
baseline has workers (killed, stalled, running hot) and sees the surge; Ballast also has
routers, Redis, the Kafka broker and etcd to lose. Applying a fault is the phase's own
(`FaultTarget`), since a plain vLLM server and a Ballast worker are stopped differently; this
module holds what both share: process trees (a vLLM server is a front process plus an engine
process) and a throttle that slows a process the way an overheating GPU slows.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Protocol, Sequence, TypeVar

from bench.common import percentile
from bench.soak.table import RequestSample
from bench.soak.traffic import Surge

WORKER_KILL, WORKER_STALL, WORKER_HOT = "worker_kill", "worker_stall", "worker_hot"
SURGE = "surge"
ROUTER_KILL, REDIS_RESTART, KAFKA_DOWN, ETCD_RESTART = "router_kill", "redis_restart", "kafka_down", "etcd_restart"
WORKER_FAULTS = (WORKER_KILL, WORKER_STALL, WORKER_HOT)
MESH_FAULTS = (ROUTER_KILL, REDIS_RESTART, KAFKA_DOWN, ETCD_RESTART)
T = TypeVar("T")

# Where in the soak (fraction of its length) each fault strikes; the surge takes 0.42-0.58
# and one kill lands inside it.
_LAYOUT = (
    (0.08, WORKER_KILL),
    (0.18, WORKER_STALL),
    (0.28, WORKER_KILL),
    (0.35, WORKER_HOT),
    (0.50, WORKER_KILL),
    (0.64, ROUTER_KILL),
    (0.72, REDIS_RESTART),
    (0.80, KAFKA_DOWN),
    (0.90, ETCD_RESTART),
)
SURGE_SPAN = (0.42, 0.58)
JITTER = 0.02
# A stall is held past the longest tier's stall timeout (B: 15 s) on a full-length soak; a
# short soak holds it past A's (5 s) at least.
STALL_HOLD_S = (6.0, 20.0)
HOT_HOLD_S = (5.0, 30.0)
KAFKA_DOWN_S = (5.0, 30.0)
# What a hot worker reports, and what it reports once cooled (the router's limit is 78 C).
HOT_C, COOL_C = 80.0, 45.0


@dataclass(frozen=True)
class ScheduledFault:
    at_s: float
    kind: str
    hold_s: float = 0.0


def _hold(bounds: tuple[float, float], duration_s: float) -> float:
    low, high = bounds
    return round(min(high, max(low, 0.08 * duration_s)), 2)


def surge_window(duration_s: float, factor: float = 3.0) -> Surge:
    return Surge(SURGE_SPAN[0] * duration_s, SURGE_SPAN[1] * duration_s, factor)


def fault_schedule(seed: int, duration_s: float, kinds: Sequence[str]) -> list[ScheduledFault]:
    """The faults of `kinds` in the layout, each jittered by up to 2 % of the soak (the same
    jitter for a fault whatever kinds are asked, so both phases share their common faults)."""
    rng = random.Random(seed)
    holds = {
        WORKER_STALL: _hold(STALL_HOLD_S, duration_s),
        WORKER_HOT: _hold(HOT_HOLD_S, duration_s),
        KAFKA_DOWN: _hold(KAFKA_DOWN_S, duration_s),
    }
    schedule = []
    for fraction, kind in _LAYOUT:
        jitter = rng.uniform(-JITTER, JITTER)
        if kind in kinds:
            schedule.append(ScheduledFault(round((fraction + jitter) * duration_s, 3), kind, holds.get(kind, 0.0)))
    return schedule


def settled_at(
    samples: Sequence[RequestSample],
    after: float,
    reference_ms: float,
    window_s: float = 5.0,
    tolerance: float = 2.0,
    until: float | None = None,
) -> float | None:
    """The end of the first `window_s` window starting at or after `after` whose requests all
    succeeded with a TTFT p99 within `tolerance` x `reference_ms`: when the load had settled.
    None when it did not within the samples (or before `until`)."""
    ends = sorted(s.end for s in samples)
    last = until if until is not None else (ends[-1] if ends else after)
    start = after
    while start + window_s <= last:
        window = [s for s in samples if start <= s.start < start + window_s]
        ttfts = [s.ttft * 1000.0 for s in window if s.ok and s.ttft is not None]
        if window and all(s.ok for s in window) and percentile(ttfts, 99) <= tolerance * reference_ms:
            return start + window_s
        start += 1.0
    return None


# The longest a worker fault waits for a worker that serves and is not under another fault
# (one killed earlier may take a minute or two to load its model again) before it strikes
# any: a fault on a worker that is down measures nothing.
VICTIM_WAIT_S = 90.0
VICTIM_POLL_S = 0.5


class Victims:
    """Which worker a fault strikes: the busiest one that serves (answers its metrics) and is
    not under another fault, so it hits work in flight and two overlapping faults hit two
    workers. A worker still starting again after an earlier fault does not answer: striking it
    would measure that fault's recovery twice. While no worker serves free of a fault the
    fault waits for one, up to `wait_s`; then it strikes any (a free one first)."""

    def __init__(
        self,
        wait_s: float = VICTIM_WAIT_S,
        poll_s: float = VICTIM_POLL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._under: set[str] = set()
        self._lock = threading.Lock()
        self._wait_s, self._poll_s = wait_s, poll_s
        self._clock, self._sleep = clock, sleep

    @contextlib.contextmanager
    def busiest(
        self, candidates: Callable[[], Sequence[T]], name: Callable[[T], str], load: Callable[[T], float | None]
    ) -> Iterator[T]:
        """The victim, counted as under a fault until the block ends. `candidates`: the
        workers alive now (read again while waiting); `load`: a candidate's requests in
        flight, None when it does not answer. LookupError when none is alive at the end of
        the wait."""
        victim = self._choose(candidates, name, load)
        try:
            yield victim
        finally:
            with self._lock:
                self._under.discard(name(victim))

    def _choose(
        self, candidates: Callable[[], Sequence[T]], name: Callable[[T], str], load: Callable[[T], float | None]
    ) -> T:
        deadline = self._clock() + self._wait_s
        while True:
            found = list(candidates())
            loads = {name(c): load(c) for c in found}
            with self._lock:
                free = [c for c in found if name(c) not in self._under]
                ready = [c for c in free if loads[name(c)] is not None]
                waited_out = self._clock() >= deadline
                if ready or (waited_out and found):
                    victim = max(ready or free or found, key=lambda c: loads[name(c)] or 0.0)
                    self._under.add(name(victim))
                    return victim
            if waited_out:
                raise LookupError("no worker alive to strike")
            self._sleep(self._poll_s)


class Struck(NamedTuple):
    """A fault as applied: the part it hit, when it struck (monotonic; a worker fault may
    wait for a worker that serves) and when the part served again (None: not observed)."""

    target: str
    struck_at: float
    recovered_at: float | None


class FaultTarget(Protocol):
    """A phase's parts, as the chaos driver sees them. `apply` blocks until the fault is
    over and the part it hit serves again (or gives up)."""

    def kinds(self) -> tuple[str, ...]: ...

    def apply(self, fault: ScheduledFault) -> Struck: ...


# -- processes ---------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the fields after the last ")" are fixed.
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z":
            continue  # exited, only not yet reaped: nothing left to stop
        children.setdefault(int(parent), []).append(int(entry.name))
    tree, queue = [], [pid]
    while queue:
        current = queue.pop(0)
        tree.append(current)
        queue.extend(children.get(current, ()))
    return tree


def signal_tree(pid: int, signum: int) -> int:
    """Sends `signum` to `pid` and every descendant; returns how many got it."""
    sent = 0
    for member in process_tree(pid):
        try:
            os.kill(member, signum)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Makes this process the reaper of its descendants' orphans, so a process one of its
    children started and left behind stays in its tree (and is found by `end_leftovers`)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def end_leftovers(grace_s: float = 10.0) -> list[int]:
    """Stops every process still below this one (after a phase's own stop: what it left
    behind), SIGTERM then SIGKILL, and reaps them; returns their pids."""
    left = process_tree(os.getpid())[1:]
    for signum in (signal.SIGCONT, signal.SIGTERM):
        for pid in left:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _reap() < len(left) and process_tree(os.getpid())[1:]:
        time.sleep(0.1)
    for pid in process_tree(os.getpid())[1:]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.2)
    _reap()
    return left


def _reap() -> int:
    """Collects exited children (orphans adopted, too); returns how many."""
    reaped = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped += 1


class Throttle:
    """Runs a process tree at `duty` of its speed (SIGSTOP for the rest of each period), as a
    GPU past its thermal limit clocks down. `stop()` leaves the tree running."""

    def __init__(self, pid: int, duty: float = 0.5, period_s: float = 0.1) -> None:
        self.pid, self.duty, self.period_s = pid, duty, period_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-throttle", daemon=True)

    def start(self) -> "Throttle":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                signal_tree(self.pid, signal.SIGSTOP)
                self._done.wait((1.0 - self.duty) * self.period_s)
                signal_tree(self.pid, signal.SIGCONT)
                self._done.wait(self.duty * self.period_s)
        finally:
            signal_tree(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
