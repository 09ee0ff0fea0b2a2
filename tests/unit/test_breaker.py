"""Circuit breaker: outcome classification, opening on fault rate, half-open probes, backoff."""

import asyncio

import grpc
import pytest
from pydantic import ValidationError

from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.router.resilience.breaker import (
    BreakerBoard,
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    Outcome,
    SlidingCounts,
    outcome,
    outcome_of,
)
from services.router.resilience.stall import StreamStalled
from tests.unit.fake_clock import FakeClock

S = grpc.StatusCode


def make(clock: FakeClock, **overrides) -> CircuitBreaker:
    return CircuitBreaker("w1", BreakerConfig(**overrides), clock)


def run(breaker: CircuitBreaker, successes: int = 0, faults: int = 0) -> None:
    for result, n in ((Outcome.SUCCESS, successes), (Outcome.FAULT, faults)):
        for _ in range(n):
            permit = breaker.try_acquire()
            assert permit is not None
            permit.record(result)


def open_breaker(breaker: CircuitBreaker) -> None:
    run(breaker, faults=20)
    assert breaker.state is BreakerState.OPEN


class TestClassify:
    @pytest.mark.parametrize("code", [None, S.OK])
    def test_success(self, code):
        assert outcome(code) is Outcome.SUCCESS

    @pytest.mark.parametrize(
        "code",
        [
            S.INVALID_ARGUMENT,
            S.UNAUTHENTICATED,
            S.NOT_FOUND,
            S.PERMISSION_DENIED,
            S.RESOURCE_EXHAUSTED,
            S.CANCELLED,
            S.DEADLINE_EXCEEDED,
        ],
    )
    def test_not_the_workers_fault(self, code):
        assert outcome(code) is Outcome.IGNORE

    @pytest.mark.parametrize("code", [S.UNAVAILABLE, S.INTERNAL, S.UNKNOWN, S.DATA_LOSS, S.UNIMPLEMENTED])
    def test_worker_faults(self, code):
        assert outcome(code) is Outcome.FAULT

    @pytest.mark.parametrize("code", [None, S.UNAVAILABLE, S.CANCELLED, S.INTERNAL])
    def test_client_cancellation_never_counts(self, code):
        assert outcome(code, client_cancelled=True) is Outcome.IGNORE

    def test_exceptions(self):
        rpc_error = grpc.aio.AioRpcError(S.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
        assert outcome_of(rpc_error) is Outcome.FAULT
        assert outcome_of(rpc_error, client_cancelled=True) is Outcome.IGNORE
        assert outcome_of(StreamStalled(2.0, 3)) is Outcome.FAULT
        assert outcome_of(Unavailable("ended without finishing")) is Outcome.FAULT
        assert outcome_of(InvalidArgument("bad")) is Outcome.IGNORE
        assert outcome_of(ResourceExhausted("full")) is Outcome.IGNORE
        assert outcome_of(asyncio.CancelledError()) is Outcome.IGNORE
        assert outcome_of(KeyError("router bug")) is Outcome.IGNORE
        assert outcome_of(None) is Outcome.SUCCESS


class TestOpening:
    def test_needs_min_requests(self):
        breaker = make(FakeClock(1000.0))
        run(breaker, faults=19)
        assert breaker.state is BreakerState.CLOSED
        run(breaker, faults=1)
        assert breaker.state is BreakerState.OPEN
        assert breaker.try_acquire() is None
        assert not breaker.available()

    def test_opens_only_above_the_rate(self):
        breaker = make(FakeClock(1000.0))
        run(breaker, successes=19, faults=1)  # exactly 5 %: not over
        assert breaker.state is BreakerState.CLOSED
        run(breaker, faults=1)  # 2 / 21
        assert breaker.state is BreakerState.OPEN

    def test_ignored_outcomes_do_not_count(self):
        breaker = make(FakeClock(1000.0))
        for _ in range(100):
            breaker.try_acquire().record(Outcome.IGNORE)
        run(breaker, successes=19, faults=1)
        snap = breaker.snapshot()
        assert (snap.state, snap.requests, snap.faults) == (BreakerState.CLOSED, 20, 1)

    def test_old_faults_slide_out_of_the_window(self):
        clock = FakeClock(1000.0)
        breaker = make(clock)
        run(breaker, faults=15)
        clock.advance(31)
        run(breaker, successes=4, faults=5)
        assert breaker.state is BreakerState.CLOSED
        assert breaker.snapshot().requests == 9


class TestHalfOpen:
    def test_cooldown_then_probes_close_it(self):
        clock = FakeClock(1000.0)
        breaker = make(clock, cooldown_s=5, half_open_probes=2)
        open_breaker(breaker)
        clock.advance(3)
        assert breaker.snapshot().half_open_in_s == pytest.approx(2)
        clock.advance(2)
        assert breaker.state is BreakerState.HALF_OPEN
        first, second = breaker.try_acquire(), breaker.try_acquire()
        assert first.probe and second.probe
        assert breaker.try_acquire() is None  # both probe slots taken
        first.record(Outcome.SUCCESS)
        assert breaker.state is BreakerState.HALF_OPEN
        assert breaker.try_acquire() is None  # one success + one in flight cover the probes
        second.record(Outcome.SUCCESS)
        assert breaker.state is BreakerState.CLOSED
        assert breaker.snapshot().requests == 0  # a fresh window after closing

    def test_ignored_probe_frees_its_slot(self):
        clock = FakeClock(1000.0)
        breaker = make(clock, half_open_probes=1)
        open_breaker(breaker)
        clock.advance(5)
        breaker.try_acquire().record(Outcome.IGNORE)
        assert breaker.state is BreakerState.HALF_OPEN
        breaker.try_acquire().record(Outcome.SUCCESS)
        assert breaker.state is BreakerState.CLOSED

    def test_failed_probe_reopens_with_growing_capped_cooldown(self):
        clock = FakeClock(1000.0)
        breaker = make(clock, cooldown_s=5, max_cooldown_s=12, half_open_probes=1)
        open_breaker(breaker)
        seen = []
        for _ in range(3):
            seen.append(breaker.snapshot().cooldown_s)
            clock.advance(seen[-1])
            breaker.try_acquire().record(Outcome.FAULT)
            assert breaker.state is BreakerState.OPEN
        assert seen == [5, 10, 12]
        assert breaker.snapshot().cooldown_s == 12
        assert breaker.snapshot().opens == 4

    def test_reopening_soon_after_closing_backs_off_and_calm_resets(self):
        clock = FakeClock(1000.0)
        breaker = make(clock, cooldown_s=5, half_open_probes=1)
        open_breaker(breaker)
        clock.advance(5)
        breaker.try_acquire().record(Outcome.SUCCESS)
        assert breaker.state is BreakerState.CLOSED
        open_breaker(breaker)  # flapping: right after closing
        assert breaker.snapshot().cooldown_s == 10
        clock.advance(10)
        breaker.try_acquire().record(Outcome.SUCCESS)
        clock.advance(60)  # a long calm
        open_breaker(breaker)
        assert breaker.snapshot().cooldown_s == 5

    def test_outcomes_of_calls_admitted_before_opening_are_ignored(self):
        clock = FakeClock(1000.0)
        breaker = make(clock, half_open_probes=1)
        long_stream = breaker.try_acquire()
        open_breaker(breaker)
        clock.advance(5)
        assert breaker.state is BreakerState.HALF_OPEN
        long_stream.record(Outcome.SUCCESS)  # not a probe: must not close the breaker
        assert breaker.state is BreakerState.HALF_OPEN
        probe = breaker.try_acquire()
        long_stream.record(Outcome.FAULT)  # already recorded: no effect
        probe.record(Outcome.SUCCESS)
        assert breaker.state is BreakerState.CLOSED


class TestPermit:
    def test_context_manager_records_what_ended_the_block(self):
        breaker = make(FakeClock(1000.0), min_requests=2)
        with breaker.try_acquire():
            pass
        assert (breaker.snapshot().requests, breaker.snapshot().faults) == (1, 0)
        with pytest.raises(Unavailable):
            with breaker.try_acquire():
                raise Unavailable("worker died")
        # One success then one fault: 50 % of 2 calls opens it (and clears the window).
        assert breaker.state is BreakerState.OPEN
        assert breaker.snapshot().opens == 1

    def test_explicit_record_wins_over_exit(self):
        breaker = make(FakeClock(1000.0))
        with pytest.raises(KeyError):
            with breaker.try_acquire() as permit:
                permit.record(Outcome.FAULT)
                raise KeyError("later")
        assert breaker.snapshot().faults == 1

    def test_release_frees_a_probe(self):
        clock = FakeClock(1000.0)
        breaker = make(clock, half_open_probes=1)
        open_breaker(breaker)
        clock.advance(5)
        breaker.try_acquire().release()
        assert breaker.available()


class TestBoard:
    def test_snapshot_transitions_and_retain(self):
        clock = FakeClock(1000.0)
        transitions = []
        board = BreakerBoard(BreakerConfig(), clock, lambda w, old, new: transitions.append((w, old, new)))
        assert board.available("w1") and board.state("w1") is BreakerState.CLOSED and len(board) == 0
        for _ in range(20):
            board.try_acquire("w1").record(Outcome.FAULT)
        board.try_acquire("w2").record(Outcome.SUCCESS)
        assert not board.available("w1")
        assert transitions == [("w1", BreakerState.CLOSED, BreakerState.OPEN)]
        snap = board.snapshot()
        assert snap["w1"].as_dict()["state"] == "open"
        assert snap["w1"].half_open_in_s == pytest.approx(5)
        assert snap["w2"].requests == 1
        permit = board.try_acquire("w2")
        board.retain(["w1"])
        permit.record(Outcome.FAULT)  # its worker is gone: harmless
        assert set(board.snapshot()) == {"w1"}


class TestConfigAndWindow:
    @pytest.mark.parametrize(
        "fields",
        [
            {"error_rate": 0},
            {"error_rate": 1},
            {"min_requests": 0},
            {"bucket_s": 40},
            {"cooldown_s": 10, "max_cooldown_s": 5},
            {"half_open_probes": 0},
            {"window_s": 3600, "bucket_s": 0.5},
        ],
    )
    def test_invalid_config(self, fields):
        with pytest.raises(ValidationError):
            BreakerConfig(**fields)

    def test_sliding_counts_are_bounded(self):
        counts = SlidingCounts(window_s=3, bucket_s=1, width=2)
        for t in range(100):
            counts.add(float(t), t % 2)
        assert counts.totals(99.5) == (1, 2)
        assert len(counts._ring) == 3
        counts.add(50.0, 0)  # a clock stepping back lands in the newest bucket
        assert counts.totals(99.5) == (2, 2)
