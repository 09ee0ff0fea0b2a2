"""The supervisor: runs child specs, restarts any child that dies, records what happened.

`start()` launches the children stage by stage (a stage's children together, then waits until
each answers its readiness probe); a child that dies during this first start fails it, since a
start-up failure (a bad setting, a taken port) is the caller's to report. After that `tick()`
(called by `run()` every `poll_s`) reaps dead children and restarts each after its backoff,
kills a child over its memory limit, and times out a restarted child that never gets ready.
`stop()` stops the children in reverse start order, SIGTERM then SIGKILL after a grace.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from services.common.backoff import RestartBackoff
from services.common.memory_watch import MB, kill_group, oom_kills, tree_rss_bytes
from services.common.processes import ManagedProcess, ProcessStartError
from services.supervisor.exits import ExitReason
from services.supervisor.spec import ChildSpec
from services.supervisor.state import write_state

log = logging.getLogger("ballast.supervisor")

# Child states, as the state file shows them.
STARTING, UP, BACKOFF, STOPPED = "starting", "up", "backoff", "stopped"


class _Child:
    """A spec and what its current incarnation is doing."""

    def __init__(self, spec: ChildSpec, order: int) -> None:
        self.spec = spec
        self.order = order
        self.process: ManagedProcess | None = None
        self.status = STOPPED
        self.restarts = 0
        self.last_exit: ExitReason | None = None
        self.backoff = RestartBackoff(spec.policy)
        self.launched_at = 0.0  # monotonic
        self.ready_at: float | None = None  # monotonic, once this incarnation answered its probe
        self.started_wall = 0.0
        self.next_start = 0.0  # monotonic, while in BACKOFF
        self.backoff_s: float | None = None
        self.oom_kills_at_launch: int | None = None
        # (cause, detail) when the supervisor itself killed this incarnation.
        self.killed_for: tuple[str, str] | None = None

    def describe(self, now: float) -> dict:
        process = self.process
        return {
            "name": self.spec.name,
            "pid": process.pid if process is not None and self.status in (STARTING, UP) else None,
            "status": self.status,
            "restarts": self.restarts,
            "stage": self.spec.stage,
            "address": self.spec.address,
            "metrics_port": self.spec.metrics_port,
            "argv0": str(self.spec.argv[0]),
            "log": str(self.spec.log_path),
            "started_at": self.started_wall or None,
            "next_start_in_s": round(max(0.0, self.next_start - now), 2) if self.status == BACKOFF else None,
            # The wait chosen after the last death (doubling while it keeps dying).
            "backoff_s": self.backoff_s,
            "last_exit": self.last_exit.to_dict() if self.last_exit is not None else None,
        }


class Supervisor:
    """Starts, watches and restarts a set of children (see the module docstring)."""

    def __init__(
        self,
        children: Iterable[ChildSpec],
        state_path: Path | None = None,
        *,
        poll_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[dict], None] | None = None,
    ) -> None:
        specs = list(children)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique: {names}")
        # Stable: within a stage, the order given.
        ordered = sorted(enumerate(specs), key=lambda item: (item[1].stage, item[0]))
        self._children = [_Child(spec, order) for order, (_, spec) in enumerate(ordered)]
        self.state_path = Path(state_path) if state_path is not None else None
        self.poll_s = poll_s
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.RLock()
        self._stop_requested = threading.Event()
        self.phase = "idle"
        self.error = ""
        #: Extra fields written at the top of the state file (the owner's own).
        self.extra_state: dict = {}

    # -- queries ---------------------------------------------------------------------------

    def child(self, name: str) -> _Child:
        return next(c for c in self._children if c.spec.name == name)

    def pid(self, name: str) -> int | None:
        c = self.child(name)
        return c.process.pid if c.process is not None and c.status in (STARTING, UP) else None

    def snapshot(self) -> dict:
        with self._lock:
            now = self._clock()
            return {
                "pid": os.getpid(),
                "phase": self.phase,
                "error": self.error,
                "updated_at": time.time(),
                **self.extra_state,
                "children": [c.describe(now) for c in self._children],
            }

    def _publish(self) -> None:
        state = self.snapshot()
        if self.state_path is not None:
            write_state(self.state_path, state)
        if self._on_change is not None:
            self._on_change(state)

    # -- first start -------------------------------------------------------------------------

    def adopt(self, spec_name: str, process: ManagedProcess) -> None:
        """Takes over a child its own launcher started and made ready (a local server that
        bootstraps itself on its first start); later restarts come from its spec."""
        with self._lock:
            c = self.child(spec_name)
            c.process = process
            c.status = UP
            c.launched_at = c.ready_at = self._clock()
            c.started_wall = time.time()
            c.oom_kills_at_launch = oom_kills()
        self._publish()

    def start(self, only: Iterable[str] | None = None) -> None:
        """Launches the children not adopted (or those named in `only`), stage by stage, each
        stage waited for; raises ProcessStartError (stopping every child) when one dies or is
        not ready within its start timeout."""
        self.phase = "starting"
        wanted = set(only) if only is not None else None
        pending = [c for c in self._children if c.status == STOPPED and (wanted is None or c.spec.name in wanted)]
        try:
            for stage in sorted({c.spec.stage for c in pending}):
                batch = [c for c in pending if c.spec.stage == stage]
                for c in batch:
                    self._launch(c, first=True)
                self._publish()
                self._wait_first_ready(batch)
                self._publish()
        except BaseException as exc:
            self.phase = "failed"
            self.error = str(exc)
            self.stop()
            raise

    def _wait_first_ready(self, batch: list[_Child]) -> None:
        waiting = list(batch)
        while waiting:
            if self._stop_requested.is_set():
                raise ProcessStartError("stopped while starting")
            for c in list(waiting):
                assert c.process is not None
                c.process.ensure_alive()  # raises with the log tail
                if self._probe(c):
                    c.status = UP
                    c.ready_at = self._clock()
                    waiting.remove(c)
                elif self._clock() - c.launched_at > c.spec.start_timeout_s:
                    raise ProcessStartError(
                        f"{c.spec.name} was not ready after {c.spec.start_timeout_s:.0f}s; log: {c.spec.log_path}",
                        log_tail=c.process.log_tail(),
                    )
            if waiting:
                time.sleep(self.poll_s)

    @staticmethod
    def _probe(c: _Child) -> bool:
        if c.spec.ready is None:
            return True
        try:
            return bool(c.spec.ready())
        except Exception:  # a probe failing means "not yet"
            return False

    def _launch(self, c: _Child, first: bool = False) -> None:
        spec = c.spec
        process = ManagedProcess(spec.name, spec.argv, log_path=spec.log_path, env=spec.env, cwd=spec.cwd)
        c.killed_for = None
        c.oom_kills_at_launch = oom_kills()
        c.launched_at = self._clock()
        c.ready_at = None
        c.started_wall = time.time()
        if not first:
            c.restarts += 1
        try:
            process.start()
        except ProcessStartError as exc:
            if first:
                raise
            # Cannot even execute it: a death like any other, retried after the backoff.
            c.process = None
            c.last_exit = ExitReason(code=None, cause="cannot start", detail=str(exc), at=time.time())
            self._back_off(c, 0.0)
            return
        c.process = process
        c.status = STARTING
        if spec.on_started is not None:
            spec.on_started(process)

    # -- supervision -------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Ticks until `stop` is set (or request_stop() is called)."""
        self.phase = "running"
        self._publish()
        stop = stop or self._stop_requested
        while not stop.wait(self.poll_s) and not self._stop_requested.is_set():
            self.tick()

    def request_stop(self) -> None:
        """Ends run() and an unfinished start() (safe from a signal handler)."""
        self._stop_requested.set()

    def tick(self) -> None:
        """One pass over the children: reap, enforce limits, restart, check readiness."""
        changed = False
        with self._lock:
            for c in self._children:
                changed |= self._tick_child(c)
        if changed:
            self._publish()

    def _tick_child(self, c: _Child) -> bool:
        now = self._clock()
        if c.status in (STARTING, UP):
            assert c.process is not None
            if not c.process.alive():
                self._died(c)
                return True
            limit = c.spec.memory_limit_mb * MB
            if limit and c.process.pid is not None:
                rss = tree_rss_bytes(c.process.pid)
                if rss > limit:
                    log.error(
                        "%s uses %d MB, over its limit of %d MB: killing it",
                        c.spec.name,
                        rss // MB,
                        c.spec.memory_limit_mb,
                    )
                    self._kill(c, "memory limit", f"memory limit: {rss // MB} MB over {c.spec.memory_limit_mb} MB")
                    return True
            if c.status == STARTING:
                if self._probe(c):
                    c.status = UP
                    c.ready_at = now
                    log.info("%s (pid %s) is ready", c.spec.name, c.process.pid)
                    return True
                if now - c.launched_at > c.spec.start_timeout_s:
                    self._kill(c, "not ready", f"not ready after {c.spec.start_timeout_s:.0f}s")
                    return True
            return False
        if c.status == BACKOFF and now >= c.next_start:
            log.info("%s: restarting (restart %d)", c.spec.name, c.restarts + 1)
            self._launch(c)
            return True
        return False

    def _kill(self, c: _Child, cause: str, detail: str) -> None:
        assert c.process is not None and c.process.pid is not None
        c.killed_for = (cause, detail)
        kill_group(c.process.pid)
        self._died(c)

    def _died(self, c: _Child) -> None:
        assert c.process is not None
        returncode = c.process.kill()  # reaps it; sweeps what is left of its group
        if returncode is None:
            returncode = -9
        cause, detail = c.killed_for or ("", "")
        if not cause and returncode == -9:
            now_kills = oom_kills()
            if now_kills is not None and c.oom_kills_at_launch is not None and now_kills > c.oom_kills_at_launch:
                cause, detail = "oom killer", "the kernel's OOM killer ran meanwhile"
        c.last_exit = ExitReason.from_returncode(returncode, cause, detail)
        # How long it served: a child that dies before it is ready was never healthy.
        self._back_off(c, self._clock() - c.ready_at if c.ready_at is not None else 0.0)

    def _back_off(self, c: _Child, uptime_s: float) -> None:
        delay = c.backoff.next_delay(uptime_s)
        c.backoff_s = delay
        c.status = BACKOFF
        c.next_start = self._clock() + delay
        what = c.last_exit.describe() if c.last_exit is not None else "ended"
        if c.backoff.at_cap:
            log.error("%s %s; it keeps dying (crash loop): restarting every %.0f s", c.spec.name, what, delay)
        else:
            log.warning("%s %s; restarting in %.1f s", c.spec.name, what, delay)

    # -- stop --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stops every child, the last started first (SIGTERM, SIGKILL after its grace). Idempotent."""
        self._stop_requested.set()
        if self.phase != "failed":
            self.phase = "stopping"
        self._publish()
        for c in sorted(self._children, key=lambda c: c.order, reverse=True):
            with self._lock:
                process, c.status = c.process, STOPPED
            if process is not None:
                try:
                    process.stop(timeout=c.spec.stop_grace_s)
                except Exception:  # keep stopping the rest
                    log.exception("stopping %s", c.spec.name)
        if self.phase != "failed":
            self.phase = "stopped"
        self._publish()
