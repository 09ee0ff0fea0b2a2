"""The local executor's failed-start backoff: real worker processes that cannot start.

A pool wants one serving replica; the worker the executor starts has no model to load (its
model folder does not exist), so it exits before registering. The executor must not start a
fresh process at every tick (each would pay Python's and the engine's imports again, on the
router's own host): the pool's next start waits `start_backoff_initial_s`, then twice that
after the next failure. The waits run on the executor's clock (a test clock here); the
failures are the processes' own exits, awaited as such.
"""

from __future__ import annotations

import uuid

import pytest

from services.router.autoscale.decision import Action, PoolSignals, Replicas, ScaleDecision
from services.router.autoscale.local_executor import LocalExecutor
from tests.component.conftest import make_config
from tests.polling import poll

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(120)]

POOL = "primary"
INITIAL_S = 10.0
SIGNALS = PoolSignals(None, None, 0, None, None, 0.0, None)


class TestClock:
    __test__ = False

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def one_serving() -> ScaleDecision:
    return ScaleDecision(POOL, 0.0, Action.SCALE_OUT, 1, 0, 0, Replicas(0), "test", SIGNALS)


async def tick(executor: LocalExecutor) -> None:
    """What the leader does each tick: count the pool (reaping exits), then apply."""
    members = await executor.members(POOL, {})
    await executor.apply(one_serving(), members)


async def wait_for_exit(executor: LocalExecutor) -> None:
    children = list(executor.children.values())
    assert len(children) == 1, f"expected one started worker, found {[c.worker_id for c in children]}"
    assert await poll(lambda: not children[0].process.alive(), timeout=60), "the worker that cannot start did not exit"


async def test_a_worker_that_cannot_start_is_started_again_only_after_a_growing_wait(etcd_server, tmp_path):
    config = make_config(
        etcd_server,
        tmp_path / "no-such-model",
        f"/ballast-test-{uuid.uuid4().hex[:8]}/",
        BALLAST__WORKER__RESPAWN="false",
        BALLAST__AUTOSCALER__ENABLED="true",
        BALLAST__AUTOSCALER__EXECUTOR="local",
        BALLAST__AUTOSCALER__LOCAL__STATE_DIR=str(tmp_path / "autoscale"),
        BALLAST__AUTOSCALER__LOCAL__START_BACKOFF_INITIAL_S=str(INITIAL_S),
        BALLAST__AUTOSCALER__LOCAL__START_BACKOFF_MAX_S="300",
        BALLAST__AUTOSCALER__LOCAL__STOP_GRACE_S="5",
    )
    clock = TestClock()
    executor = LocalExecutor(config, "r1", clock=clock)
    try:
        await tick(executor)
        first = set(executor.children)
        await wait_for_exit(executor)

        # The exit is reaped: no process left, and none started in its place while the wait runs.
        for _ in range(5):
            await tick(executor)
        assert executor.children == {}
        assert executor.starts_held_s(POOL) == INITIAL_S

        clock.now += INITIAL_S
        await tick(executor)
        second = set(executor.children)
        assert len(second) == 1 and second != first, "the wait is over: one new worker is started"
        await wait_for_exit(executor)

        await tick(executor)
        assert executor.children == {}
        assert executor.starts_held_s(POOL) == 2 * INITIAL_S, "a second failure in a row doubles the wait"
        clock.now += INITIAL_S
        await tick(executor)
        assert executor.children == {}, "still inside the doubled wait"
    finally:
        await executor.close()
