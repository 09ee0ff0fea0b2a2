"""A pytest plugin that says where a hanging test waits.

pytest-timeout prints thread stacks, but an asyncio test that hangs shows only the event loop
idling in `select`. Shortly before the timeout fires, this plugin prints the stack of every
asyncio task of the running loop, so the awaited call that never returned is named.
"""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

# Seconds before pytest-timeout's deadline at which the tasks are printed.
MARGIN_S = 10.0


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 0)


def _await_chain(coro) -> list[str]:
    """Where a coroutine waits: each frame down its chain of awaits."""
    lines = []
    while coro is not None and len(lines) < 40:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return lines


def _print_tasks(nodeid: str) -> None:
    print(f"\n=== asyncio tasks of {nodeid} (still running near its timeout) ===", file=sys.stderr)
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}", file=sys.stderr)
        print("\n".join(_await_chain(task.get_coro())), file=sys.stderr)
    sys.stderr.flush()


def _main_thread_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on the main thread, found from its current frames."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, asyncio.AbstractEventLoop) and candidate.is_running():
            return candidate
        frame = frame.f_back
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    timeout = _timeout_of(item)
    done = threading.Event()

    def watch() -> None:
        if done.wait(max(1.0, timeout - MARGIN_S)):
            return
        loop = _main_thread_loop()
        if loop is not None:
            loop.call_soon_threadsafe(_print_tasks, item.nodeid)

    if timeout > 0:
        threading.Thread(target=watch, name="hang-report", daemon=True).start()
    try:
        yield
    finally:
        done.set()
