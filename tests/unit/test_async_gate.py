"""AsyncGate: waiting for a slot, handing it on, preemption, refusal, cancellation safety."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.errors import DeadlineExceeded, ResourceExhausted
from services.router.scheduling.async_gate import AsyncGate, Grant
from services.router.scheduling.scheduler import PoolScheduler, TicketState
from services.router.scheduling.tiers import TierPolicy
from tests.unit.fake_clock import FakeClock


def make_gate(workers=None, clock=None, **overrides) -> tuple[AsyncGate, FakeClock, dict]:
    clock = clock or FakeClock()
    policy = TierPolicy.from_mapping({"initial_hold_s": 0.01, "initial_first_token_s": 0.001, **overrides})
    pool = dict(workers or {"w1": (1, 0)})
    gate = AsyncGate(PoolScheduler(policy, clock), lambda: pool)
    return gate, clock, pool


async def settle() -> None:
    # Lets every ready task run; no timers involved.
    for _ in range(5):
        await asyncio.sleep(0)


async def use(gate: AsyncGate, ticket, release: asyncio.Event | None = None) -> str:
    """Takes a slot, optionally holds it until released, returns the worker it had."""
    async with gate.slot(ticket) as grant:
        worker = grant.worker_id
        if release is not None:
            await release.wait()
    return worker


def assert_empty(gate: AsyncGate) -> None:
    assert gate.waiting == 0 and gate.holders == 0
    assert gate.scheduler.queued() == 0 and gate.scheduler.running() == 0


async def test_grant_names_the_worker_and_exit_hands_the_slot_on():
    gate, _, _ = make_gate()
    scheduler = gate.scheduler
    first = scheduler.new_ticket("r1", "t", "A")
    second = scheduler.new_ticket("r2", "t", "A")
    got: list[str] = []

    async def second_holder():
        async with gate.slot(second) as grant:
            got.append(grant.worker_id)

    async with gate.slot(first) as grant:
        assert grant.worker_id == "w1"
        task = asyncio.create_task(second_holder())
        await settle()
        assert got == [] and second.state is TicketState.QUEUED
    await asyncio.wait_for(task, 1)
    assert got == ["w1"]
    assert first.state is second.state is TicketState.DONE
    assert_empty(gate)


async def test_refusal_raises_resource_exhausted_with_retry_hint():
    gate, _, _ = make_gate(tiers={"A": {"max_queue": 1}})
    scheduler = gate.scheduler
    holder = scheduler.new_ticket("hold", "t", "A")
    async with gate.slot(holder):
        waiter = asyncio.create_task(use(gate, scheduler.new_ticket("q", "t", "A")))
        await settle()
        with pytest.raises(ResourceExhausted) as error:
            async with gate.slot(scheduler.new_ticket("full", "t", "A")):
                pass
        assert "queue is full" in error.value.message
        assert error.value.retry_after_s >= scheduler.policy.min_retry_after_s
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter


async def test_cancelled_waiter_leaves_the_queue():
    gate, _, _ = make_gate()
    scheduler = gate.scheduler
    served: list[str] = []

    async def serve(rid):
        await use(gate, scheduler.new_ticket(rid, "t", "A"))
        served.append(rid)

    holder = scheduler.new_ticket("hold", "t", "A")
    async with gate.slot(holder):
        doomed = asyncio.create_task(serve("doomed"))
        await settle()
        assert scheduler.queued() == 1
        doomed.cancel()
        await settle()
        assert scheduler.queued() == 0 and gate.waiting == 0
        later = asyncio.create_task(serve("later"))
        await settle()
    await asyncio.wait_for(later, 1)
    assert served == ["later"]
    assert doomed.cancelled()
    assert_empty(gate)


async def test_cancelled_holder_frees_its_slot():
    gate, _, _ = make_gate()
    scheduler = gate.scheduler
    inside = asyncio.Event()

    async def hold_forever():
        async with gate.slot(scheduler.new_ticket("hold", "t", "A")):
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(hold_forever())
    await asyncio.wait_for(inside.wait(), 1)
    assert scheduler.running() == 1
    task.cancel()
    await settle()
    assert scheduler.running() == 0
    async with gate.slot(scheduler.new_ticket("next", "t", "A")) as grant:
        assert grant.worker_id == "w1"
    assert_empty(gate)


async def test_waiter_dispatched_and_cancelled_in_the_same_instant_gives_the_slot_back():
    gate, _, _ = make_gate()
    scheduler = gate.scheduler
    holder = scheduler.new_ticket("hold", "t", "A")
    async with gate.slot(holder):
        waiter_ticket = scheduler.new_ticket("w", "t", "A")
        waiter = asyncio.create_task(use(gate, waiter_ticket))
        await settle()
    # The holder left: the waiter got the slot, but is cancelled before it resumes.
    assert waiter_ticket.state is TicketState.RUNNING
    waiter.cancel()
    await settle()
    assert waiter_ticket.state is TicketState.CANCELLED
    assert_empty(gate)


async def test_error_in_the_body_frees_the_slot_without_a_hold_sample():
    gate, clock, _ = make_gate()
    scheduler = gate.scheduler
    with pytest.raises(RuntimeError):
        async with gate.slot(scheduler.new_ticket("r", "t", "A")):
            clock.advance(50.0)
            raise RuntimeError("worker broke")
    assert scheduler.snapshot().hold_s == pytest.approx(0.01)
    assert_empty(gate)


async def test_s_preempts_the_b_holder_which_resumes_with_its_tokens():
    gate, _, _ = make_gate()
    scheduler = gate.scheduler
    b_ticket = scheduler.new_ticket("b", "t", "B")
    s_ticket = scheduler.new_ticket("s", "t", "S")
    callbacks: list[Grant] = []
    events: list[str] = []
    s_done = asyncio.Event()

    async def strict():
        async with gate.slot(s_ticket) as grant:
            events.append(f"s on {grant.worker_id}")
        s_done.set()

    async with gate.slot(b_ticket, on_preempt=callbacks.append) as grant:
        grant.add_tokens([1, 2, 3])
        task = asyncio.create_task(strict())
        await asyncio.wait_for(grant.preempted.wait(), 1)
        assert callbacks == [grant]
        events.append("b preempted")
        worker = await asyncio.wait_for(grant.resume(), 1)
        events.append(f"b resumed on {worker}")
        assert not grant.preempted.is_set()
        assert s_done.is_set()
    await task
    assert events == ["b preempted", "s on w1", "b resumed on w1"]
    assert b_ticket.preemptions == 1 and b_ticket.generated_ids == [1, 2, 3]
    assert scheduler.counters.preempted["B"] == 1
    assert_empty(gate)


async def test_a_holder_is_never_preempted():
    gate, _, _ = make_gate()
    scheduler = gate.scheduler
    async with gate.slot(scheduler.new_ticket("a", "t", "A")) as grant:
        task = asyncio.create_task(use(gate, scheduler.new_ticket("s", "t", "S")))
        await settle()
        assert not grant.preempted.is_set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert_empty(gate)


async def test_queued_ticket_past_its_limit_is_refused():
    gate, clock, _ = make_gate()
    scheduler = gate.scheduler
    async with gate.slot(scheduler.new_ticket("hold", "t", "A")):
        waiter = asyncio.create_task(use(gate, scheduler.new_ticket("late", "t", "A")))
        await settle()
        clock.advance(2.5)
        gate.pump()
        with pytest.raises(ResourceExhausted, match="without a free slot"):
            await asyncio.wait_for(waiter, 1)
    assert scheduler.counters.expired["A"] == 1
    assert_empty(gate)


async def test_client_deadline_passing_while_queued_is_deadline_exceeded():
    gate, clock, _ = make_gate()
    scheduler = gate.scheduler
    async with gate.slot(scheduler.new_ticket("hold", "t", "A")):
        ticket = scheduler.new_ticket("late", "t", "A", client_deadline=clock() + 0.5)
        waiter = asyncio.create_task(use(gate, ticket))
        await settle()
        clock.advance(0.5)
        gate.pump()
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(waiter, 1)
    assert_empty(gate)


async def test_wait_is_bounded_in_real_time_too():
    # With the real clock nobody needs to pump: the waiter's own timeout ends the wait.
    gate, _, _ = make_gate(clock=time.monotonic, tiers={"A": {"max_wait_s": 0.02}})
    scheduler = gate.scheduler
    async with gate.slot(scheduler.new_ticket("hold", "t", "A")):
        with pytest.raises(ResourceExhausted):
            async with gate.slot(scheduler.new_ticket("late", "t", "A")):
                pass
    assert_empty(gate)


async def test_new_capacity_is_used_when_pumped():
    gate, _, pool = make_gate(tiers={"A": {"budget_s": 100}})
    scheduler = gate.scheduler
    async with gate.slot(scheduler.new_ticket("hold", "t", "A")):
        waiter = asyncio.create_task(use(gate, scheduler.new_ticket("w", "t", "A")))
        await settle()
        assert not waiter.done()
        pool["w2"] = (1, 0)
        gate.pump()
        assert await asyncio.wait_for(waiter, 1) == "w2"
    assert_empty(gate)
