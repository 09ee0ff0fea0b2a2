"""Keeps a worker process running: a crashed worker is back in about half a second.

Most of a worker's cold start is importing torch (about 2 s of CPU, more than the model
load and warm-up together). With `worker.respawn` on, the process that starts is a keeper:
it imports the engine's modules once, then forks the serving worker. When that worker dies
(a crash, the OOM killer, SIGKILL), the keeper forks a fresh one from its already-imported
state, so only the model load and warm-up are paid again. The fresh worker registers under
the same id: routers see a new incarnation, as after any restart.

What the keeper does not hide:
- A first worker that dies before it was ready (bad model folder, port taken) ends the
  keeper with that worker's exit status: start-up failures are the orchestrator's to retry.
  A fresh worker that dies before it was ready, after an earlier one served, is a crash like
  any other and is started again: the same settings started before, so what ended it is the
  host (killed again while it loaded, out of memory), and giving up would leave the worker
  gone for good after two faults in a row.
- More than `respawn_max` crashes within `respawn_window_s` end the keeper with status 1,
  so a crash loop shows as one to the orchestrator instead of spinning here.
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
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

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
    max_crashes: int
    window_s: float


class CrashLoop:
    """Counts crashes in a sliding window; says when there were too many."""

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

    def __init__(self, serve: Callable[[Callable[[], None]], int], policy: RespawnPolicy) -> None:
        # serve(ready) runs the worker in the child and returns its exit status; it calls
        # ready() once the worker takes requests.
        self._serve = serve
        self._loop = CrashLoop(policy)
        self._child: int | None = None
        self._stopping = False
        # Whether any worker of this keeper became ready: until then a death is a start-up failure.
        self._served = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        while True:
            status, was_ready = self._run_child()
            self._served = self._served or was_ready
            what = describe_status(status) + ("" if was_ready else " before it was ready")
            if self._stopping:
                log.info("keeper: worker %s after the stop signal", what)
                return exit_code(status)
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                log.info("keeper: worker exited cleanly; stopping")
                return 0
            if not self._served:
                log.error("keeper: worker %s; not starting another", what)
                return exit_code(status) or 1
            if self._loop.crashed():
                log.error("keeper: worker %s; more than %d crashes in %.0f s, giving up", what,
                          self._loop.policy.max_crashes, self._loop.policy.window_s)
                return 1
            log.warning("keeper: worker %s; starting a fresh one", what)

    def _forward(self, signum: int, _frame) -> None:
        self._stopping = True
        if self._child is not None:
            try:
                os.kill(self._child, signum)
            except ProcessLookupError:
                pass

    def _run_child(self) -> tuple[int, bool]:
        """Forks one worker and waits for it: (its wait status, whether it became ready)."""
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
        try:
            # Blocks until the worker says it is ready, or EOF when it dies first.
            was_ready = os.read(read_end, 1) == _READY
        finally:
            os.close(read_end)
        _, status = os.waitpid(pid, 0)
        self._child = None
        _end_group(pid)
        return status, was_ready

    def _child_main(self, keeper: int, ready_fd: int, stop_signals: set[signal.Signals]) -> int:
        try:
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
