"""PoolScheduler: tier order, budgets, admission from measured times, fairness, preemption."""

from __future__ import annotations

import math

import pytest

from services.router.scheduling.scheduler import PoolScheduler, Ticket, TicketState, WorkerSlots, slots_from_records
from services.router.scheduling.tiers import AdaptiveShares, TierPolicy, TierSpec
from tests.unit.fake_clock import FakeClock

# A quick prior, so admission does not get in the way of tests about order.
FAST = dict(initial_hold_s=0.01, initial_first_token_s=0.001)


def make(mode: str = "tiered", workers=None, **overrides) -> tuple[PoolScheduler, FakeClock]:
    clock = FakeClock()
    policy = TierPolicy.from_mapping({"mode": mode, **FAST, **overrides})
    scheduler = PoolScheduler(policy, clock, pool="primary")
    scheduler.observe_workers(workers or {"w1": (1, 0)})
    return scheduler, clock


def submit(s: PoolScheduler, rid: str, tier: str = "A", tenant: str = "t", **kw) -> Ticket:
    ticket = s.new_ticket(rid, tenant, tier, **kw)
    admission = s.submit(ticket)
    assert admission.admitted, admission
    return ticket


def drain_one_at_a_time(s: PoolScheduler, workers, clock: FakeClock, steps: int, hold_s: float = 0.01) -> list[str]:
    """Lets one slot free up at a time; returns request ids in dispatch order."""
    order: list[str] = []
    for _ in range(steps):
        plan = s.dispatch(workers)
        for ticket, _ in plan.started:
            order.append(ticket.request_id)
        clock.advance(hold_s)
        for ticket, _ in plan.started:
            s.on_finished(ticket)
    return order


def occupy(s: PoolScheduler, workers, rid: str = "busy", tier: str = "A") -> Ticket:
    ticket = submit(s, rid, tier)
    plan = s.dispatch(workers)
    assert [t.request_id for t, _ in plan.started] == [rid]
    return ticket


class TestOrder:
    def test_s_first_then_edf_within_tier(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        busy = occupy(s, workers)
        late = submit(s, "a-late", "A")
        clock.advance(0.1)
        urgent = submit(s, "a-urgent", "A", weight=2.0)  # deadline 0.1 + 2.0/2 < 2.0
        submit(s, "s", "S")
        assert urgent.deadline < late.deadline
        s.on_finished(busy)
        assert drain_one_at_a_time(s, workers, clock, 3) == ["s", "a-urgent", "a-late"]

    def test_client_deadline_moves_a_ticket_forward_within_its_tier(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        busy = occupy(s, workers)
        submit(s, "first", "A")
        submit(s, "tight", "A", client_deadline=clock() + 0.5)
        s.on_finished(busy)
        assert drain_one_at_a_time(s, workers, clock, 2) == ["tight", "first"]

    def test_fifo_mode_ignores_tiers(self):
        s, clock = make(mode="fifo")
        workers = {"w1": (1, 0)}
        busy = occupy(s, workers, tier="B")
        for rid, tier in [("b", "B"), ("a", "A"), ("s", "S")]:
            submit(s, rid, tier)
        s.on_finished(busy)
        assert drain_one_at_a_time(s, workers, clock, 3) == ["b", "a", "s"]


class TestCapacity:
    def test_never_more_than_advertised_capacity(self):
        s, _ = make()
        for i in range(10):
            submit(s, f"r{i}")
        plan = s.dispatch({"w1": (3, 0), "w2": WorkerSlots(2, 1)})
        per_worker: dict[str, int] = {}
        for _, worker in plan.started:
            per_worker[worker] = per_worker.get(worker, 0) + 1
        # w2 publishes one in flight elsewhere: one slot left there.
        assert per_worker == {"w1": 3, "w2": 1}
        assert s.dispatch().started == []
        assert s.queued() == 6

    def test_published_count_is_read_net_of_our_own_streams(self):
        s, _ = make()
        tickets = [submit(s, f"r{i}") for i in range(4)]
        assert len(s.dispatch({"w1": (3, 1)}).started) == 2  # one slot is another router's
        # The worker has not published our two streams yet: still no room.
        assert s.dispatch({"w1": (3, 1)}).started == []
        # Its heartbeat now counts ours too: still full, not over.
        assert s.dispatch({"w1": (3, 3)}).started == []
        # Ours finished before the next heartbeat: the stale 3 still leaves them free.
        for ticket in tickets[:2]:
            s.on_finished(ticket)
        assert len(s.dispatch({"w1": (3, 3)}).started) == 2

    def test_finished_ticket_frees_its_slot(self):
        s, _ = make()
        first, second = submit(s, "r1"), submit(s, "r2")
        assert [t for t, _ in s.dispatch({"w1": (1, 0)}).started] == [first]
        assert s.on_finished(first)
        assert [t for t, _ in s.dispatch().started] == [second]
        assert first.state is TicketState.DONE

    def test_avoided_worker_is_skipped_and_preferred_worker_chosen(self):
        s, _ = make()
        avoid = submit(s, "avoid", avoid={"w1"})
        prefer = submit(s, "prefer", prefer="w1")
        plan = dict((t.request_id, w) for t, w in s.dispatch({"w1": (1, 0), "w2": (1, 0)}).started)
        assert plan == {"avoid": "w2", "prefer": "w1"}
        assert avoid.state is prefer.state is TicketState.RUNNING

    def test_ticket_whose_only_free_worker_is_avoided_waits_without_blocking_others(self):
        s, _ = make()
        blocked = submit(s, "blocked", avoid={"w1"})
        other = submit(s, "other")
        plan = s.dispatch({"w1": (1, 0)})
        assert [t for t, _ in plan.started] == [other]
        assert blocked.state is TicketState.QUEUED

    def test_requeue_failed_goes_to_another_worker(self):
        s, _ = make()
        ticket = submit(s, "r1")
        ((_, first),) = s.dispatch({"w1": (1, 0), "w2": (1, 0)}).started
        assert s.requeue_failed(ticket)
        ((_, second),) = s.dispatch().started
        assert second != first

    def test_a_worker_that_joins_ramps_up_instead_of_taking_every_new_stream(self):
        s, clock = make(slow_start_s=5.0, workers={"w1": (8, 0), "w2": (8, 0)})
        occupied = [occupy(s, {"w1": (8, 0), "w2": (8, 0)}, rid=f"busy{i}") for i in range(4)]
        assert {t.worker_id for t in occupied} == {"w1", "w2"}  # 2 of 8 busy on each
        clock.advance(10)
        # w3 restarts with every slot free: at first it counts a tenth of them.
        workers = {"w1": (8, 0), "w2": (8, 0), "w3": (8, 0)}
        for i in range(4):
            submit(s, f"new{i}")
        placed = [w for _, w in s.dispatch(workers).started]
        assert "w3" not in placed
        # Half-way through its window it counts half: it wins once the others are over half full.
        clock.advance(2.5)
        for i in range(4):
            submit(s, f"later{i}")
        placed = [w for _, w in s.dispatch(workers).started]
        assert placed.count("w3") >= 1
        # After the window it is a worker like the others: the freest, it takes the next one.
        clock.advance(2.5)
        submit(s, "last")
        assert [w for _, w in s.dispatch(workers).started] == ["w3"]

    def test_workers_present_at_start_and_a_zero_window_get_their_full_share(self):
        for window, first in ((5.0, {"w1": (8, 4), "w2": (8, 0)}), (0.0, {"w1": (8, 4)})):
            s, _ = make(slow_start_s=window, workers=first)
            submit(s, "r")
            assert [w for _, w in s.dispatch({"w1": (8, 4), "w2": (8, 0)}).started] == ["w2"]

    def test_slots_from_records(self):
        class Record:
            def __init__(self, id, capacity, in_flight):
                self.id, self.capacity, self.in_flight = id, capacity, in_flight

        assert slots_from_records([Record("w", 4, 1)]) == {"w": WorkerSlots(4, 1)}


class TestBudgetsAndExpiry:
    def test_deadlines_follow_the_tier_budgets(self):
        s, clock = make()
        clock.advance(10)
        budgets = {tier: s.new_ticket("r", "t", tier) for tier in "SAB"}
        assert budgets["S"].deadline == pytest.approx(10.8)
        assert budgets["A"].deadline == pytest.approx(12.0)
        assert budgets["B"].expires_at == pytest.approx(25.0)

    def test_queued_a_expires_at_its_budget(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        occupy(s, workers)
        waiting = submit(s, "a")
        clock.advance(1.99)
        assert s.dispatch(workers).expired == []
        clock.advance(0.02)
        plan = s.dispatch(workers)
        assert plan.expired == [waiting]
        assert waiting.state is TicketState.EXPIRED
        assert s.queued() == 0
        assert s.counters.expired["A"] == 1

    def test_b_waits_in_the_delay_queue_at_most_15s(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        occupy(s, workers)
        b = submit(s, "b", "B")
        clock.advance(14.9)
        assert s.dispatch(workers).expired == []
        assert b.state is TicketState.QUEUED
        clock.advance(0.1)
        assert s.dispatch(workers).expired == [b]

    def test_b_is_not_starved_by_an_a_flood(self):
        # Even at the highest A share, B gets its (1 - 0.9) of the releases.
        s, clock = make(tiers={"A": {"max_queue": 100}})
        workers = {"w1": (1, 0)}
        busy = occupy(s, workers)
        for i in range(40):
            submit(s, f"a{i}", "A", tenant=f"t{i % 4}")
        submit(s, "b", "B")
        s.on_finished(busy)
        order = drain_one_at_a_time(s, workers, clock, 12)
        assert "b" in order[:10]

    def test_expiry_index_stays_bounded(self):
        s, _ = make(tiers={"A": {"max_queue": 10}})
        for i in range(2000):
            ticket = submit(s, f"r{i}")
            s.cancel(ticket)
        assert len(s._expiry) <= 2 * s.queued() + 65


class TestAdaptiveShares:
    def test_a_share_rises_with_load(self):
        shares = AdaptiveShares(a_share_low=0.6, a_share_high=0.9, load_low=1.0, load_high=3.0)
        assert shares.a_share(0.0) == 0.6
        assert shares.a_share(2.0) == pytest.approx(0.75)
        assert shares.a_share(10.0) == 0.9

    @staticmethod
    def _a_among_first_ten(capacity: int, queued_each: int) -> int:
        s, _ = make(tiers={"A": {"max_queue": 100}, "B": {"max_queue": 100}})
        for i in range(queued_each):
            submit(s, f"a{i}", "A")
            submit(s, f"b{i}", "B")
        started = s.dispatch({"w1": (capacity, 0)}).started
        return sum(1 for t, _ in started[:10] if t.tier == "A")

    def test_a_gets_more_of_the_slots_under_load(self):
        # Calm: 20 queued for 100 slots (load 0.3) -> A share 0.6.
        calm = self._a_among_first_ten(capacity=100, queued_each=10)
        # Busy: 80 queued against 10 slots (load 8) -> A share 0.9.
        busy = self._a_among_first_ten(capacity=10, queued_each=40)
        assert calm == 6
        assert busy == 9


class TestTenantFairness:
    def test_a_flood_does_not_delay_another_tenant_beyond_one_slot(self):
        s, clock = make(tiers={"A": {"max_queue": 100}})
        workers = {"w1": (1, 0)}
        busy = occupy(s, workers)
        for i in range(50):
            submit(s, f"x{i}", tenant="x")
        submit(s, "y", tenant="y")
        s.on_finished(busy)
        order = drain_one_at_a_time(s, workers, clock, 2)
        assert "y" in order

    def test_fifo_baseline_would_have_delayed_it(self):
        s, clock = make(mode="fifo")
        workers = {"w1": (1, 0)}
        busy = occupy(s, workers)
        for i in range(50):
            submit(s, f"x{i}", tenant="x")
        submit(s, "y", tenant="y")
        s.on_finished(busy)
        assert "y" not in drain_one_at_a_time(s, workers, clock, 50)

    def test_estimated_wait_accounts_for_round_robin(self):
        s, _ = make(initial_hold_s=1.0, tiers={"A": {"max_queue": 100, "budget_s": 1000}})
        workers = {"w1": (1, 0)}
        occupy(s, workers)
        for i in range(20):
            submit(s, f"x{i}", tenant="x")
        assert s.estimated_wait("A", "y") == pytest.approx(2.0)  # one x turn, then y
        assert s.estimated_wait("A", "x") == pytest.approx(21.0)


class TestAdmission:
    def _measure_hold(self, s: PoolScheduler, clock: FakeClock, workers, hold_s: float, n: int = 3) -> None:
        for i in range(n):
            ticket = submit(s, f"m{hold_s}-{i}")
            s.dispatch(workers)
            clock.advance(hold_s)
            s.on_finished(ticket)

    def test_estimate_comes_from_the_measured_hold_time(self):
        s, clock = make(tiers={"A": {"max_queue": 100, "budget_s": 1000}})
        workers = {"w1": (2, 0)}
        self._measure_hold(s, clock, workers, hold_s=4.0)
        assert s.snapshot().hold_s == pytest.approx(4.0)
        occupy(s, workers, "busy1")
        occupy(s, workers, "busy2")
        for i in range(3):
            submit(s, f"q{i}")
        # 3 ahead + itself = 4 releases; 2 slots every 4 s = 0.5 releases/s.
        assert s.estimated_wait("A", "t") == pytest.approx(8.0)

    def test_hold_time_is_a_moving_average(self):
        s, clock = make(tiers={"A": {"budget_s": 1000}})
        self._measure_hold(s, clock, {"w1": (1, 0)}, hold_s=4.0)
        self._measure_hold(s, clock, {"w1": (1, 0)}, hold_s=1.0, n=1)
        assert s.snapshot().hold_s == pytest.approx(0.8 * 4.0 + 0.2 * 1.0)

    def test_refused_over_budget_with_a_retry_hint_from_measurements(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        self._measure_hold(s, clock, workers, hold_s=3.0)
        occupy(s, workers)
        ticket = s.new_ticket("late", "t", "A")
        admission = s.submit(ticket)
        assert not admission.admitted
        assert admission.reason == "over_budget"
        assert admission.estimated_wait_s == pytest.approx(3.0)
        # Within budget once 3.0 - (2.0 - first-token time) seconds have drained.
        assert admission.retry_after_s == pytest.approx(3.0 - (2.0 - 0.001), rel=0.01)
        assert ticket.state is TicketState.REFUSED
        assert s.counters.refused[("A", "over_budget")] == 1
        assert s.queued() == 0

    def test_same_queue_is_admitted_when_service_is_fast(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        self._measure_hold(s, clock, workers, hold_s=0.5)
        occupy(s, workers)
        assert s.submit(s.new_ticket("ok", "t", "A")).admitted

    def test_slow_first_token_eats_into_the_budget(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        first = submit(s, "slow-prefill")
        s.dispatch(workers)
        clock.advance(1.9)
        s.on_first_token(first)
        s.on_finished(first)
        occupy(s, workers)  # hold measured 1.9 s, first token 1.9 s
        admission = s.submit(s.new_ticket("a", "t", "A"))
        assert admission.reason == "over_budget"

    def test_s_is_admitted_when_it_can_preempt_b(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        self._measure_hold(s, clock, workers, hold_s=10.0)
        occupy(s, workers, tier="B")
        admission = s.submit(s.new_ticket("s", "t", "S"))
        assert admission.admitted and admission.estimated_wait_s == 0.0

    def test_queue_full_is_refused_at_once(self):
        s, _ = make(tiers={"A": {"max_queue": 2, "budget_s": 1000}})
        occupy(s, {"w1": (1, 0)})
        submit(s, "q1")
        submit(s, "q2")
        ticket = s.new_ticket("q3", "t", "A")
        admission = s.submit(ticket)
        assert (admission.admitted, admission.reason) == (False, "queue_full")
        assert admission.retry_after_s >= s.policy.min_retry_after_s
        assert ticket.state is TicketState.REFUSED
        assert s.queued("A") == 2
        # Other tiers have their own bound.
        assert s.submit(s.new_ticket("b", "t", "B")).admitted

    def test_fifo_mode_only_applies_the_queue_bound(self):
        s, clock = make(mode="fifo", fifo_max_queue=3, initial_hold_s=100.0)
        occupy(s, {"w1": (1, 0)})
        for i in range(3):
            submit(s, f"q{i}", "S")  # a wait far over the S budget is still queued
        admission = s.submit(s.new_ticket("q3", "t", "S"))
        assert admission.reason == "queue_full"

    def test_no_workers_means_no_capacity(self):
        s, _ = make()
        admission = s.submit(s.new_ticket("r", "t", "A"), workers={})
        assert (admission.admitted, admission.reason) == (False, "no_capacity")
        assert math.isinf(admission.estimated_wait_s)

    def test_resubmitting_a_ticket_is_an_error(self):
        s, _ = make()
        ticket = submit(s, "r")
        with pytest.raises(ValueError, match="already submitted"):
            s.submit(ticket)


class TestPreemption:
    def _running(self, s: PoolScheduler, clock: FakeClock, workers, plan: list[tuple[str, str]]) -> dict[str, Ticket]:
        tickets = {}
        for rid, tier in plan:
            tickets[rid] = occupy(s, workers, rid, tier)
            clock.advance(1.0)
        return tickets

    def test_youngest_b_is_preempted_and_resumes_with_its_tokens(self):
        s, clock = make()
        workers = {"w1": (3, 0)}
        running = self._running(s, clock, workers, [("b-old", "B"), ("b-young", "B"), ("a", "A")])
        running["b-young"].add_tokens([5, 6, 7])
        strict = submit(s, "s", "S")
        assert s.dispatch(workers).started == []
        assert s.preempt_candidate_for(strict) is running["b-young"]
        assert s.plan_preemptions() == [running["b-young"]]
        # Already under way: asking again does not take a second stream.
        assert s.plan_preemptions() == []
        assert s.requeue_preempted(running["b-young"])
        assert [t for t, _ in s.dispatch(workers).started] == [strict]
        young = running["b-young"]
        assert (young.state, young.preemptions, young.generated_ids) == (TicketState.QUEUED, 1, [5, 6, 7])
        s.on_finished(strict)
        assert [t for t, _ in s.dispatch(workers).started] == [young]
        assert s.counters.preempted["B"] == 1

    def test_preemption_limit(self):
        s, clock = make(max_preemptions=1)
        workers = {"w1": (2, 0)}
        running = self._running(s, clock, workers, [("b-old", "B"), ("b-young", "B")])
        young, old = running["b-young"], running["b-old"]
        young.preemptions = 1
        strict = submit(s, "s", "S")
        # The younger stream has used its preemption: the older one yields instead.
        assert s.preempt_candidate_for(strict) is old
        old.preemptions = 1
        assert s.preempt_candidate_for(strict) is None
        assert s.plan_preemptions() == []

    def test_a_is_never_preempted(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        self._running(s, clock, workers, [("a", "A")])
        submit(s, "s", "S")
        assert s.plan_preemptions() == []

    def test_no_preemption_while_a_slot_is_free(self):
        s, clock = make()
        workers = {"w1": (2, 0)}
        self._running(s, clock, workers, [("b", "B")])
        submit(s, "s", "S")
        assert s.plan_preemptions() == []

    def test_fifo_never_preempts(self):
        s, clock = make(mode="fifo")
        workers = {"w1": (1, 0)}
        self._running(s, clock, workers, [("b", "B")])
        strict = submit(s, "s", "S")
        assert s.preempt_candidate_for(strict) is None
        assert s.plan_preemptions() == []

    def test_requeued_ticket_expires_at_its_client_deadline(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        b = submit(s, "b", "B", client_deadline=clock() + 1.0)
        s.dispatch(workers)
        clock.advance(1.0)
        assert not s.requeue_preempted(b)
        assert b.state is TicketState.EXPIRED
        assert s.running() == 0


class TestCancel:
    def test_cancel_queued_and_running(self):
        s, _ = make()
        workers = {"w1": (1, 0)}
        running = occupy(s, workers)
        queued = submit(s, "q")
        assert s.cancel(queued)
        assert s.queued() == 0
        assert s.cancel(running)
        assert s.running() == 0
        assert not s.cancel(running)  # idempotent
        after = submit(s, "after")
        assert [t for t, _ in s.dispatch(workers).started] == [after]


class TestPolicy:
    @pytest.mark.parametrize(
        "data, field",
        [
            ({"tiers": {"A": {"budget_s": -1}}}, "tiers.A.budget_s"),
            ({"tiers": {"B": {"max_queue": 0}}}, "tiers.B.max_queue"),
            ({"tiers": {"X": {}}}, "tiers.X"),
            ({"shares": {"a_share_low": 0.9, "a_share_high": 0.5}}, "shares.a_share_high"),
            ({"shares": {"a_share_high": 1.0}}, "shares.a_share_high"),
            ({"max_preemptions": -1}, "max_preemptions"),
            ({"mode": "lifo"}, "mode"),
            ({"budget": 1}, "budget"),
        ],
    )
    def test_bad_values_name_the_field(self, data, field):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            TierPolicy.from_mapping(data)

    def test_partial_override_keeps_defaults(self):
        policy = TierPolicy.from_mapping({"tiers": {"B": {"max_wait_s": 5.0}}})
        assert policy.spec("B") == TierSpec(budget_s=15.0, max_queue=512, max_wait_s=5.0)
        assert policy.spec("S").budget_s == 0.8

    def test_snapshot_reports_queues_and_waits(self):
        s, clock = make()
        workers = {"w1": (1, 0)}
        occupy(s, workers)
        submit(s, "q", "B")
        clock.advance(2.0)
        snap = s.snapshot()
        assert snap.tiers["B"].queued == 1
        assert snap.tiers["B"].oldest_wait_s == pytest.approx(2.0)
        assert snap.tiers["A"].running == 1
        assert snap.free_slots == 0 and snap.capacity == 1


def test_idle_workers_share_sequential_requests():
    from tests.unit.fake_clock import FakeClock
    from services.router.scheduling.scheduler import PoolScheduler, WorkerSlots
    from services.router.scheduling.tiers import TierPolicy

    scheduler = PoolScheduler(TierPolicy(), FakeClock())
    workers = {"w1": WorkerSlots(4, 0), "w2": WorkerSlots(4, 0), "w3": WorkerSlots(4, 0)}
    chosen = []
    for i in range(6):
        ticket = scheduler.new_ticket(f"r{i}", "t", "A")
        assert scheduler.submit(ticket, workers).admitted
        plan = scheduler.dispatch(workers)
        chosen.append(plan.started[0][1])
        scheduler.on_finished(ticket)
    assert set(chosen) == {"w1", "w2", "w3"}
