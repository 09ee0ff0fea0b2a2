"""Keeps a worker process running: a crashed worker is back in about half a second.

Most of a worker's cold start is importing torch (about 2 s of CPU, more than the model
load and warm-up together). With `worker.respawn` on, the process that starts is a keeper:
it imports the engine's modules once, then forks the serving worker. When that worker dies
(a crash, the OOM killer, SIGKILL), the keeper forks a fresh one from its already-imported
state, so only the model load and warm-up are paid again. The fresh worker registers under
the same id: routers see a new incarnation, as after any restart.

Every death is followed by a restart, after a backoff: 0.5 s, doubling with each death in
a row up to 30 s, and back to 0.5 s once a worker served for a healthy period
(`worker.respawn_backoff_*`, `worker.respawn_healthy_s`). A worker that keeps dying is a crash loop: more than
`respawn_max` deaths within `respawn_window_s` log an error (and so does each wait at the
cap), but the keeper goes on trying, at the capped pace, as Kubernetes does for a container.

With `worker.memory_limit_mb` set, a thread of the keeper polls the resident memory of the
worker and everything it started (every 100 ms) and SIGKILLs the worker's group once it is
over the limit: the worker dies alone, before the host's OOM killer picks some other process,
and its death is logged as "memory limit". A SIGKILL the keeper did not send, while the
kernel's OOM kill count rose, is logged as the OOM killer's.

What the keeper does not hide:
- A first worker that dies before it was ready (bad model folder, port taken) ends the
  keeper with that worker's exit status: start-up failures are the orchestrator's to retry.
  A fresh worker that dies before it was ready, after an earlier one served, is a death like
  any other and is started again: the same settings started before, so what ended it is the
  host (killed again while it loaded, out of memory).
- A worker that exits on its own with status 0 (it drained) ends the keeper with 0.

SIGTERM or SIGINT to the keeper is passed to the worker, which drains as usual; the keeper
exits with the worker's status. The worker runs in its own process group (a signal sent to
the keeper's group reaches it once, through the keeper, not twice) and dies with the keeper
(PR_SET_PDEATHSIG), so killing the keeper never leaves a worker behind. When a worker dies,
the keeper kills what is left in its process group: vLLM's engine process, which does not
end with a worker killed or stopped by a signal.

The keeper imports modules and reads config, nothing more: no gRPC channel or server, no
etcd client, no telemetry exists before the fork (gRPC supports fork only before its first
channel or server), so the worker inherits no connection and no half-held lock.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import select
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from services.common.backoff import BackoffPolicy, RestartBackoff
from services.common.memory_watch import MB, MemoryWatch, oom_kills

log = logging.getLogger("ballast.worker.keeper")

_PR_SET_PDEATHSIG = 1
_READY = b"R"

# What each engine's worker imports at start that is worth having before the fork.
PRELOAD = {
    "torch": ("torch", "services.worker.torch.llama", "services.worker.torch.model_runner"),
    "vllm": ("torch",),
    "sim": ("tokenizers", "services.worker.sim.engine", "services.worker.sim.control"),
}


@dataclass(frozen=True)
class RespawnPolicy:
    """When a crash loop is reported, how long restarts wait, and the worker's memory limit."""

    max_crashes: int
    window_s: float
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    memory_limit_mb: int = 0

    @classmethod
    def from_settings(cls, worker) -> "RespawnPolicy":
        """From the worker section of the config (services/worker/settings.py)."""
        return cls(
            worker.respawn_max,
            worker.respawn_window_s,
            BackoffPolicy(
                initial_s=worker.respawn_backoff_initial_s,
                max_s=worker.respawn_backoff_max_s,
                reset_after_s=worker.respawn_healthy_s,
            ),
            worker.memory_limit_mb,
        )


class CrashLoop:
    """Counts crashes in a sliding window; says when there were too many (a crash loop)."""

    def __init__(self, policy: RespawnPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._crashes: deque[float] = deque()

    def crashed(self) -> bool:
        """Records a crash; True when the window now holds more than the policy allows."""
        now = self._clock()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.policy.window_s:
            self._crashes.popleft()
        return len(self._crashes) > self.policy.max_crashes


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def exit_code(status: int) -> int:
    """The status a shell would report for the worker (128 + signal when killed)."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def preload(engine: str) -> None:
    started = time.monotonic()
    for module in PRELOAD.get(engine, ()):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            # The worker itself will fail on it, with its own message, where it matters.
            log.warning("keeper: could not preload %s (%s)", module, exc)
    log.info("keeper: preloaded the %s engine's modules in %.1f s", engine, time.monotonic() - started)


class Keeper:
    """Forks the serving worker and forks it again when it dies (see the module docstring)."""

    def __init__(
        self,
        serve: Callable[[Callable[[], None]], int],
        policy: RespawnPolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # serve(ready) runs the worker in the child and returns its exit status; it calls
        # ready() once the worker takes requests.
        self._serve = serve
        self.policy = policy
        self._loop = CrashLoop(policy, clock)
        self._backoff = RestartBackoff(policy.backoff)
        self._clock = clock
        self._child: int | None = None
        self._wakeup_read = -1  # set by run()
        self._stopping = False
        # Whether any worker of this keeper became ready: until then a death is a start-up failure.
        self._served = False
        #: Worker deaths so far (each followed by a restart).
        self.restarts = 0
        self._ready_at: float | None = None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        # A signal's Python handler runs between bytecodes; one that lands just before a
        # blocking call would wait for that call to return. The keeper waits in select() on
        # this pipe as well, so a stop signal wakes it at once (see _wait_for_worker).
        self._wakeup_read, wakeup_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
        while True:
            status, was_ready, cause = self._run_child()
            self._served = self._served or was_ready
            what = (
                describe_status(status)
                + (f" ({cause})" if cause else "")
                + ("" if was_ready else " before it was ready")
            )
            if self._stopping:
                log.info("keeper: worker %s after the stop signal", what)
                return exit_code(status)
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                log.info("keeper: worker exited cleanly; stopping")
                return 0
            if not self._served:
                log.error("keeper: worker %s; not starting another", what)
                return exit_code(status) or 1
            # How long it served: a worker that dies while it loads was never healthy.
            served_s = self._clock() - self._ready_at if self._ready_at is not None else 0.0
            delay = self._backoff.next_delay(served_s)
            if self._loop.crashed():
                log.error(
                    "keeper: crash loop: more than %d worker deaths within %.0f s; still restarting",
                    self.policy.max_crashes,
                    self.policy.window_s,
                )
            self.restarts += 1
            log.warning("keeper: worker %s; starting a fresh one in %.1f s (restart %d)", what, delay, self.restarts)
            if not self._sleep(delay):
                log.info("keeper: stop signal while waiting to restart the worker")
                return 0

    def _sleep(self, delay_s: float) -> bool:
        """Waits out a backoff in short steps; False when a stop signal came meanwhile."""
        deadline = self._clock() + delay_s
        while not self._stopping:
            left = deadline - self._clock()
            if left <= 0:
                return True
            time.sleep(min(left, 0.05))
        return False

    def _forward(self, signum: int, _frame) -> None:
        self._stopping = True
        if self._child is not None:
            try:
                os.kill(self._child, signum)
            except ProcessLookupError:
                pass

    def _run_child(self) -> tuple[int, bool, str]:
        """Forks one worker and waits for it: (its wait status, whether it became ready, what
        killed it when that can be told: the memory limit or the OOM killer, else "")."""
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        keeper = os.getpid()
        # A stop signal between the fork and `self._child = pid` would find no child to pass
        # on to, and the keeper would wait for a worker that never heard it: held back until
        # the child is known (a signal that came meanwhile is delivered at the unblock).
        stop_signals = {signal.SIGTERM, signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        try:
            pid = os.fork()
            if pid == 0:  # the worker
                os.close(read_end)
                os._exit(self._child_main(keeper, write_end, stop_signals))
            self._child = pid
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
        os.close(write_end)
        kills_before = oom_kills()
        # Started after the fork and stopped before the next one: a fork copies one thread.
        watch = MemoryWatch(pid, self.policy.memory_limit_mb * MB).start() if self.policy.memory_limit_mb > 0 else None
        try:
            status, was_ready = self._wait_for_worker(pid, read_end)
        finally:
            if watch is not None:
                watch.stop()
        self._child = None
        _end_group(pid)
        cause = (watch.reason() if watch is not None else None) or ""
        if not cause and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            kills_after = oom_kills()
            if kills_before is not None and kills_after is not None and kills_after > kills_before:
                cause = "the kernel's OOM killer"
        return status, was_ready, cause

    def _wait_for_worker(self, pid: int, ready_fd: int) -> tuple[int, bool]:
        """Waits until the worker has ended: (its wait status, whether it said it was ready).

        Not in a blocking read or waitpid: a SIGTERM that landed just before such a call
        would have its handler (which passes it on to the worker) run only once the call
        returned, that is once the worker ended, which without the signal it never does.
        select() also wakes for the signal wakeup pipe, so the handler runs at once."""
        worker = os.pidfd_open(pid)
        watched = [worker, ready_fd, self._wakeup_read]
        was_ready = False
        try:
            while True:
                readable, _, _ = select.select(watched, [], [])
                if self._wakeup_read in readable:
                    _drain(self._wakeup_read)  # the handler itself runs as select returns
                if ready_fd in readable:
                    # One byte when the worker is ready; EOF when it died before.
                    was_ready = os.read(ready_fd, 1) == _READY
                    self._ready_at = self._clock() if was_ready else None
                    watched.remove(ready_fd)
                if worker in readable:
                    _, status = os.waitpid(pid, 0)  # it has ended: does not block
                    return status, was_ready
        finally:
            os.close(ready_fd)
            os.close(worker)

    def _child_main(self, keeper: int, ready_fd: int, stop_signals: set[signal.Signals]) -> int:
        try:
            # The keeper's wakeup pipe is not the worker's, which sets up its own signals.
            os.close(signal.set_wakeup_fd(-1))
            os.close(self._wakeup_read)
            for sig in stop_signals:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)  # blocked across the fork
            os.setpgid(0, 0)
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != keeper:
                return 1  # the keeper died between the fork and the prctl

            def ready() -> None:
                os.write(ready_fd, _READY)
                os.close(ready_fd)

            return self._serve(ready)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            logging.getLogger("ballast.worker").exception("worker crashed")
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass  # empty


def _end_group(worker_pid: int) -> None:
    """Kills what a dead worker left in its process group. vLLM runs its engine in a process
    of its own that outlives a worker killed or stopped by a signal (on a GPU it would keep
    the GPU's memory); started by the worker, it is in the worker's group."""
    try:
        os.killpg(worker_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # nothing was left


def serving_pid(keeper_pid: int) -> int | None:
    """The pid of the worker a keeper runs now (None between two): for tools and benchmarks."""
    try:
        with open(f"/proc/{keeper_pid}/task/{keeper_pid}/children") as children:
            pids = children.read().split()
    except OSError:
        return None
    return int(pids[0]) if pids else None
