"""StepScheduler with a fake batch runner: priority order, decode batching, abandoned and
failing steps, and stop.

The compute thread is held busy with a threading.Event so that every test queues its jobs
while one job is known to be running; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Sequence

import pytest

from services.common.errors import Unavailable
from services.worker.torch.step_scheduler import DecodeStep, StepScheduler

WAIT_S = 5.0


class FakeRunner:
    """A batch runner that answers `token + 1` per step (or what `answers` says for a seq),
    and records every batch it ran."""

    def __init__(self, answers: dict | None = None) -> None:
        self.batches: list[list[tuple]] = []
        self.answers = answers or {}
        self.log: list[str] = []  # shared with calls, so the order of all jobs is visible

    def __call__(self, steps: Sequence[DecodeStep]) -> list:
        self.batches.append([(s.seq, s.token, s.priority) for s in steps])
        self.log.append("batch:" + ",".join(str(s.seq) for s in steps))
        return [self.answers.get(s.seq, s.token + 1) for s in steps]


class Gate:
    """A call that holds the compute thread until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> str:
        self.entered.set()
        assert self.release.wait(WAIT_S), "gate never released"
        return "gate"

    async def wait_entered(self) -> None:
        ok = await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, WAIT_S)
        assert ok, "gate call never started"


async def settle(tasks: list[asyncio.Task]) -> None:
    """Lets freshly created tasks run up to their first await (enqueueing their job)."""
    for _ in range(5):
        await asyncio.sleep(0)
    assert not any(t.done() for t in tasks), "a job finished while the thread was held"


async def hold(scheduler: StepScheduler) -> tuple[Gate, asyncio.Task]:
    gate = Gate()
    task = asyncio.create_task(scheduler.call(gate, priority=0))
    await gate.wait_entered()
    return gate, task


async def gather(*tasks: asyncio.Task) -> list:
    return await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)


@pytest.fixture
def runner():
    return FakeRunner()


@pytest.fixture
async def scheduler(runner):
    s = StepScheduler(runner)
    s.start()
    yield s
    await s.stop()


async def test_queued_jobs_run_in_priority_then_arrival_order(scheduler, runner):
    gate, held = await hold(scheduler)

    def record(name: str) -> str:
        runner.log.append(name)
        return name

    tasks = [
        asyncio.create_task(scheduler.call(record, "c2", priority=2)),
        asyncio.create_task(scheduler.decode("d2a", 10, None, priority=2)),
        asyncio.create_task(scheduler.decode("d2b", 20, None, priority=2)),
        asyncio.create_task(scheduler.call(record, "c1-first", priority=1)),
        asyncio.create_task(scheduler.call(record, "c1-second", priority=1)),
        # Queued after the priority-2 decode steps, and still runs before them.
        asyncio.create_task(scheduler.call(record, "c0", priority=0)),
    ]
    await settle(tasks)
    gate.release.set()
    results = await gather(held, *tasks)

    assert results == ["gate", "c2", 11, 21, "c1-first", "c1-second", "c0"]
    # c2 arrived before the decode steps of equal priority, so it runs before them.
    assert runner.log == ["c0", "c1-first", "c1-second", "c2", "batch:d2a,d2b"]


async def test_waiting_decode_steps_run_as_one_batch(scheduler, runner):
    gate, held = await hold(scheduler)
    tasks = [asyncio.create_task(scheduler.decode(f"s{i}", 100 * i, None, priority=i % 3)) for i in range(5)]
    await settle(tasks)
    assert scheduler.batches == 0
    gate.release.set()

    assert await gather(*tasks) == [1, 101, 201, 301, 401]
    await held
    assert len(runner.batches) == 1
    # Every waiting step in the one batch, most urgent first (priority, then arrival).
    assert runner.batches[0] == [("s0", 0, 0), ("s3", 300, 0), ("s1", 100, 1), ("s4", 400, 1), ("s2", 200, 2)]
    assert (scheduler.batches, scheduler.batched_steps) == (1, 5)


async def test_a_stream_that_joins_mid_batch_merges_into_the_next_batch():
    """Sequences answered by a batch ask for their next step before the next pick, so a
    latecomer waiting alone rides with them instead of starting a batch of its own (which
    would make the two groups alternate, each pass half full, for as long as they run)."""
    in_first_batch, latecomer_queued = threading.Event(), threading.Event()

    class FirstBatchWaits(FakeRunner):
        def __call__(self, steps):
            if not self.batches:
                in_first_batch.set()
                assert latecomer_queued.wait(WAIT_S), "the latecomer never queued"
            return super().__call__(steps)

    runner = FirstBatchWaits()
    scheduler = StepScheduler(runner)
    scheduler.start()

    async def stream(seq: str, steps: int) -> int:
        token = 0
        for _ in range(steps):
            token = await scheduler.decode(seq, token, None)
        return token

    try:
        early = [asyncio.create_task(stream(f"a{i}", 5)) for i in range(4)]
        ok = await asyncio.get_running_loop().run_in_executor(None, in_first_batch.wait, WAIT_S)
        assert ok, "the first batch never started"
        late = asyncio.create_task(stream("late", 5))
        await settle([late])
        latecomer_queued.set()
        assert await gather(*early, late) == [5, 5, 5, 5, 5]
    finally:
        await scheduler.stop()
    assert [len(batch) for batch in runner.batches] == [4, 5, 5, 5, 5, 1]


async def test_max_batch_splits_most_urgent_first():
    runner = FakeRunner()
    scheduler = StepScheduler(runner, max_batch=2)
    scheduler.start()
    try:
        gate, held = await hold(scheduler)
        priorities = [2, 1, 2, 0, 1]
        tasks = [asyncio.create_task(scheduler.decode(f"s{i}", i, None, priority=p)) for i, p in enumerate(priorities)]
        await settle(tasks)
        gate.release.set()
        assert await gather(*tasks) == [1, 2, 3, 4, 5]
        await held
    finally:
        await scheduler.stop()
    assert [[seq for seq, _t, _p in batch] for batch in runner.batches] == [["s3", "s1"], ["s4", "s0"], ["s2"]]
    assert (scheduler.batches, scheduler.batched_steps) == (3, 5)


async def test_step_cancelled_before_dispatch_is_not_run(scheduler, runner):
    gate, held = await hold(scheduler)
    kept = asyncio.create_task(scheduler.decode("kept", 1, None))
    dropped = asyncio.create_task(scheduler.decode("dropped", 2, None))
    dropped_call = asyncio.create_task(scheduler.call(runner.log.append, "dropped-call"))
    await settle([kept, dropped, dropped_call])
    dropped.cancel()
    dropped_call.cancel()
    gate.release.set()

    assert await gather(kept) == [2]
    await held
    with pytest.raises(asyncio.CancelledError):
        await dropped
    with pytest.raises(asyncio.CancelledError):
        await dropped_call
    assert runner.batches == [[("kept", 1, 1)]]
    assert runner.log == ["batch:kept"]
    assert scheduler.batched_steps == 1


async def test_failed_step_fails_only_its_awaiter():
    runner = FakeRunner(answers={"bad": ValueError("bad step")})
    scheduler = StepScheduler(runner)
    scheduler.start()
    try:
        gate, held = await hold(scheduler)
        tasks = [asyncio.create_task(scheduler.decode(seq, 7, None)) for seq in ("a", "bad", "b")]
        await settle(tasks)
        gate.release.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
        await held
    finally:
        await scheduler.stop()
    assert results[0] == 8 and results[2] == 8
    assert isinstance(results[1], ValueError) and str(results[1]) == "bad step"
    assert len(runner.batches) == 1 and scheduler.batched_steps == 3


async def test_raising_batch_runner_fails_its_whole_batch_and_keeps_dispatching():
    calls = 0

    def flaky(steps: Sequence[DecodeStep]) -> list:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("forward pass failed")
        return [s.token for s in steps]

    scheduler = StepScheduler(flaky)
    scheduler.start()
    try:
        gate, held = await hold(scheduler)
        tasks = [asyncio.create_task(scheduler.decode(i, i, None)) for i in range(2)]
        await settle(tasks)
        gate.release.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
        await held
        assert all(isinstance(r, RuntimeError) for r in results)
        # The dispatcher survived: the next step runs.
        assert await asyncio.wait_for(scheduler.decode(5, 5, None), WAIT_S) == 5
    finally:
        await scheduler.stop()


async def test_call_reraises_its_exception_in_the_caller(scheduler):
    def boom(x: int) -> int:
        raise KeyError(x)

    with pytest.raises(KeyError) as caught:
        await asyncio.wait_for(scheduler.call(boom, 42), WAIT_S)
    assert caught.value.args == (42,)
    # Later calls still run, on the scheduler's own thread.
    name = await asyncio.wait_for(scheduler.call(lambda: threading.current_thread().name), WAIT_S)
    assert name.startswith("torch-engine")


async def test_stop_fails_waiting_jobs_and_later_calls():
    runner = FakeRunner()
    scheduler = StepScheduler(runner)
    scheduler.start()
    gate, held = await hold(scheduler)
    waiting = [
        asyncio.create_task(scheduler.call(runner.log.append, "never")),
        asyncio.create_task(scheduler.decode("s", 1, None)),
    ]
    await settle(waiting)

    stopping = asyncio.create_task(scheduler.stop())
    # The waiting jobs fail while the held job is still on the thread.
    results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), WAIT_S)
    assert all(isinstance(r, Unavailable) for r in results), results
    assert not stopping.done()  # stop waits for the thread's job to finish
    gate.release.set()
    await asyncio.wait_for(stopping, WAIT_S)
    await asyncio.wait_for(asyncio.gather(held, return_exceptions=True), WAIT_S)

    assert not scheduler.running
    assert runner.log == [] and runner.batches == []
    with pytest.raises(Unavailable):
        await scheduler.call(runner.log.append, "after stop")
    with pytest.raises(Unavailable):
        await scheduler.decode("s", 1, None)


async def test_calls_before_start_raise_unavailable():
    scheduler = StepScheduler(FakeRunner())
    with pytest.raises(Unavailable):
        await scheduler.call(print)


async def test_stop_iteration_in_a_call_fails_that_call_only(scheduler):
    # asyncio cannot carry StopIteration in a future; unconverted, the caller would hang.
    with pytest.raises(RuntimeError, match="StopIteration"):
        await asyncio.wait_for(scheduler.call(next, iter([])), WAIT_S)
    assert await asyncio.wait_for(scheduler.call(int, "5"), WAIT_S) == 5


async def test_runner_giving_too_few_results_fails_the_batch_instead_of_hanging():
    scheduler = StepScheduler(lambda steps: [7])
    scheduler.start()
    try:
        gate, held = await hold(scheduler)
        steps = [asyncio.create_task(scheduler.decode(name, 1, None)) for name in ("a", "b")]
        await settle(steps)
        gate.release.set()
        results = await asyncio.wait_for(asyncio.gather(*steps, return_exceptions=True), WAIT_S)
        assert all(isinstance(r, RuntimeError) for r in results), results
        await held
    finally:
        await scheduler.stop()


async def test_waiting_prefills_run_together_within_the_token_budget():
    prefills: list[list[tuple]] = []

    def run_prefills(steps):
        prefills.append([(s.seq, len(s.ids)) for s in steps])
        return [len(s.ids) for s in steps]

    runner = FakeRunner()
    scheduler = StepScheduler(runner, run_prefills=run_prefills, max_prefill_tokens=10)
    scheduler.start()
    try:
        gate, held = await hold(scheduler)
        jobs = [
            asyncio.create_task(scheduler.prefill(name, [0] * n, None, priority))
            for name, n, priority in (("a", 4, 1), ("b", 4, 1), ("c", 4, 1), ("s", 3, 0))
        ]
        decode = asyncio.create_task(scheduler.decode("d", 1, None, priority=1))
        await settle([*jobs, decode])
        gate.release.set()
        assert await gather(*jobs) == [4, 4, 4, 3]
        await gather(decode, held)
        # The most urgent alone (no lower tier rides along), then by arrival, at most 10
        # tokens a pass; the overflow still goes before the decode step that arrived after it.
        assert prefills == [[("s", 3)], [("a", 4), ("b", 4)], [("c", 4)]]
        assert runner.batches == [[("d", 1, 1)]]
    finally:
        await scheduler.stop()


async def test_prefill_batches_keep_to_the_time_budget_once_the_cost_is_measured():
    import time

    batches: list[int] = []

    def run_prefills(steps):  # 1 ms per token
        batches.append(len(steps))
        time.sleep(0.001 * sum(len(s.ids) for s in steps))
        return [0 for _ in steps]

    scheduler = StepScheduler(FakeRunner(), run_prefills=run_prefills, max_prefill_tokens=512, prefill_budget_ms=20)
    scheduler.start()
    try:
        for _round in range(2):
            gate, held = await hold(scheduler)
            jobs = [asyncio.create_task(scheduler.prefill(i, [0] * 8, None)) for i in range(5)]
            await settle(jobs)
            gate.release.set()
            await gather(*jobs, held)
        # Unmeasured, all five went at once; measured at >= 1 ms a token, 20 ms holds two.
        assert batches[0] == 5
        assert all(n <= 2 for n in batches[1:]) and sum(batches[1:]) == 5
    finally:
        await scheduler.stop()


async def test_completed_counts_finished_jobs_and_stands_still_while_the_thread_is_held(scheduler, runner):
    """The engine's step count (what its worker reports as progress): each batch and call the
    thread finished, failed ones too; a job still on the thread (a hung forward pass) adds
    nothing however long it takes."""
    gate, held = await hold(scheduler)
    tasks = [asyncio.create_task(scheduler.decode(f"s{i}", i, None)) for i in range(3)]
    await settle(tasks)
    assert scheduler.completed == 0

    def boom() -> None:
        raise KeyError("x")

    failing = asyncio.create_task(scheduler.call(boom))
    await settle([failing])
    assert scheduler.completed == 0  # held: nothing finished however many jobs wait
    gate.release.set()
    await gather(held, *tasks)
    with pytest.raises(KeyError):
        await asyncio.wait_for(failing, WAIT_S)
    # The gate, the failing call and one batch of the three decode steps.
    assert scheduler.completed == 3
