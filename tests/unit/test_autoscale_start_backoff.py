"""The local executor's failed-start backoff as bookkeeping: which exits count as failed
starts, and what ends the wait (the processes are stand-ins; the integration test
tests/integration/test_autoscale_start_backoff.py starts real ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError
from services.common.membership import WorkerRecord
from services.common.worker_roles import SERVING
from services.config import load_config
from services.router.autoscale.local_executor import LocalExecutor, LocalWorker

POOL = "primary"


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


class StandInProcess:
    """What the executor asks of a worker's process: alive or not, and how it ended."""

    def __init__(self, alive: bool) -> None:
        self._alive = alive
        self.log_path = Path("worker.log")

    def alive(self) -> bool:
        return self._alive

    def exit_status(self) -> int | None:
        return None if self._alive else 1


def executor_with(clock: Clock, tmp_path: Path) -> LocalExecutor:
    config = load_config(
        environ={
            "BALLAST__AUTOSCALER__LOCAL__STATE_DIR": str(tmp_path),
            "BALLAST__AUTOSCALER__LOCAL__START_BACKOFF_INITIAL_S": "10",
            "BALLAST__AUTOSCALER__LOCAL__START_BACKOFF_MAX_S": "25",
        }
    )
    return LocalExecutor(config, "r1", clock=clock)


def started(executor: LocalExecutor, worker_id: str, alive: bool, clock: Clock) -> None:
    executor.children[worker_id] = LocalWorker(worker_id, POOL, SERVING, StandInProcess(alive), clock())  # type: ignore[arg-type]


def record(worker_id: str) -> WorkerRecord:
    return WorkerRecord(id=worker_id, address="127.0.0.1:1", model="tiny", model_version="v1", pool=POOL)


async def test_exits_before_registering_double_the_wait_up_to_its_cap(tmp_path):
    clock = Clock()
    executor = executor_with(clock, tmp_path)
    waits = []
    for n in range(3):
        started(executor, f"w{n}", alive=False, clock=clock)
        await executor.members(POOL, {})
        waits.append(executor.starts_held_s(POOL))
    assert waits == [10, 20, 25]
    clock.now += 25
    assert executor.starts_held_s(POOL) == 0


async def test_a_worker_that_registered_and_then_exited_is_no_failed_start(tmp_path):
    clock = Clock()
    executor = executor_with(clock, tmp_path)
    started(executor, "w1", alive=True, clock=clock)
    await executor.members(POOL, {"w1": record("w1")})
    executor.children["w1"].process = StandInProcess(alive=False)  # type: ignore[assignment]

    await executor.members(POOL, {})

    assert executor.starts_held_s(POOL) == 0
    assert executor.children == {}


async def test_a_started_worker_that_registers_ends_the_wait_and_the_streak(tmp_path):
    clock = Clock()
    executor = executor_with(clock, tmp_path)
    started(executor, "w1", alive=False, clock=clock)
    await executor.members(POOL, {})
    assert executor.starts_held_s(POOL) == 10

    # A worker started before the failure (still loading then) registers.
    started(executor, "w2", alive=True, clock=clock)
    await executor.members(POOL, {"w2": record("w2")})
    assert executor.starts_held_s(POOL) == 0

    # The next failure waits the first wait again, not the second.
    started(executor, "w3", alive=False, clock=clock)
    await executor.members(POOL, {"w2": record("w2")})
    assert executor.starts_held_s(POOL) == 10


async def test_another_pools_failures_hold_nothing_here(tmp_path):
    clock = Clock()
    executor = executor_with(clock, tmp_path)
    executor.children["x1"] = LocalWorker("x1", "light", SERVING, StandInProcess(alive=False), clock())  # type: ignore[arg-type]
    await executor.members("light", {})

    assert executor.starts_held_s("light") == 10
    assert executor.starts_held_s(POOL) == 0


def test_a_cap_below_the_first_wait_is_refused():
    def backoff(initial: str, cap: str):
        return load_config(
            environ={
                "BALLAST__AUTOSCALER__LOCAL__START_BACKOFF_INITIAL_S": initial,
                "BALLAST__AUTOSCALER__LOCAL__START_BACKOFF_MAX_S": cap,
            }
        )

    assert backoff("30", "30").autoscaler.local.start_backoff_max_s == 30
    with pytest.raises(ConfigError):
        backoff("30", "10")
