"""The failover decision on its own: for each way an attempt can end (preempted, bad input, a
lost or stalled worker, a lease gone, a worker's error answer, a passed deadline, a spent
budget), what the router does next and what the worker's breaker, marks and the request's
quarantine tally are told; the retry budget is asked only when nothing else rules a retry out."""

import dataclasses

import grpc
import pytest

from services.common.errors import (
    BallastError,
    DeadlineExceeded,
    Draining,
    InvalidArgument,
    RetryBudgetExhausted,
    Unavailable,
)
from services.common.faults import status_trailers
from services.router.resilience.breaker import Outcome
from services.router.resilience.failover import (
    Action,
    AttemptFailure,
    Preempted,
    StreamEndedEarly,
    WorkerLeaseLost,
    WorkerProgress,
    decide,
    lease_quiet_s,
)
from tests.unit.fake_clock import FakeClock
from services.router.resilience.quarantine import Implication
from services.router.resilience.retry_budget import Refusal
from services.router.resilience.stall import StreamStalled


def rpc_error(code: grpc.StatusCode, details: str, trailers: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


def worker_answer(error: BallastError) -> grpc.aio.AioRpcError:
    """The status a live worker sends for `error`, trailers included."""
    return rpc_error(error.code, error.message, status_trailers(error))


CONNECTION_LOST = rpc_error(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")


class Budget:
    """A retry budget that answers `refusal` and counts how often it was asked."""

    def __init__(self, refusal: Refusal | None = None) -> None:
        self.refusal = refusal
        self.asked = 0

    def __call__(self) -> Refusal | None:
        self.asked += 1
        return self.refusal


def failure(
    error: BaseException, *, sent: int = 0, this_attempt: int = 0, accepted: bool = True, deadline_passed: bool = False
) -> AttemptFailure:
    return AttemptFailure(
        error,
        "w1",
        tokens_sent=sent,
        tokens_this_attempt=this_attempt,
        accepted=accepted,
        deadline_passed=deadline_passed,
    )


def test_preemption_pauses_without_judging_the_worker_or_spending_the_budget():
    budget = Budget()
    decision = decide(failure(Preempted(), sent=5, this_attempt=5), budget)
    assert (decision.action, decision.reason, decision.breaker) == (Action.PAUSE, "preempted", Outcome.IGNORE)
    assert not (decision.mark_unreachable or decision.rollout_fault)
    assert decision.implication is Implication.NONE
    assert budget.asked == 0


def test_bad_input_fails_with_its_own_error_and_says_nothing_about_the_worker():
    budget = Budget()
    error = InvalidArgument("response_format does not match")
    decision = decide(failure(error), budget)
    assert decision.action is Action.FAIL and decision.error is error
    assert decision.breaker is Outcome.IGNORE and decision.implication is Implication.NONE
    assert budget.asked == 0


@pytest.mark.parametrize("sent, action", [(0, Action.RETRY), (7, Action.RESUME)])
def test_a_lost_worker_is_marked_unreachable_and_spared_its_breaker(sent, action):
    budget = Budget()
    decision = decide(failure(CONNECTION_LOST, sent=sent, this_attempt=sent), budget)
    assert (decision.action, decision.reason) == (action, "worker_lost")
    assert decision.mark_unreachable and decision.breaker is Outcome.IGNORE
    assert budget.asked == 1


@pytest.mark.parametrize("error", [CONNECTION_LOST, StreamStalled(2.0, 0), WorkerLeaseLost("gone")])
def test_a_worker_lost_taking_the_request_on_implicates_the_request(error):
    taken_on = decide(failure(error, sent=4, this_attempt=0, accepted=True), Budget())
    assert taken_on.implication is Implication.TAKEN_ON
    # Before the router read that it took the call on: unconfirmed (it counts, but never
    # quarantines alone); once it relayed tokens of this attempt: not at all.
    unread = decide(failure(error, sent=4, this_attempt=0, accepted=False), Budget())
    assert unread.implication is Implication.UNCONFIRMED
    streaming = decide(failure(error, sent=4, this_attempt=3, accepted=True), Budget())
    assert streaming.implication is Implication.NONE
    # An attempt that asked its worker to confirm and was lost before the accepted event was
    # read never reached the engine: not the request's doing (workers lost together).
    unconfirmed = dataclasses.replace(failure(error, sent=4, this_attempt=0, accepted=False), confirm_asked=True)
    assert decide(unconfirmed, Budget()).implication is Implication.NONE
    confirmed = dataclasses.replace(failure(error, sent=4, this_attempt=0, accepted=True), confirm_asked=True)
    assert decide(confirmed, Budget()).implication is Implication.TAKEN_ON
    # Waiting behind a full prefill batch: implicated, and marked so for the quarantine's excuse.
    queued = decide(dataclasses.replace(failure(error, sent=4, this_attempt=0, accepted=True), queued=True), Budget())
    assert queued.implication is Implication.TAKEN_ON and queued.queued
    assert not decide(failure(error, sent=4, this_attempt=0, accepted=True), Budget()).queued


def test_a_stalled_worker_counts_against_its_breaker_but_stays_reachable():
    decision = decide(failure(StreamStalled(2.0, 3), sent=3, this_attempt=3), Budget())
    assert (decision.action, decision.reason) == (Action.RESUME, "stalled")
    assert decision.breaker is Outcome.FAULT and decision.rollout_fault
    assert not decision.mark_unreachable


def test_a_lost_lease_moves_the_stream_and_marks_the_worker():
    decision = decide(failure(WorkerLeaseLost("lease gone"), sent=2, this_attempt=2), Budget())
    assert (decision.action, decision.reason) == (Action.RESUME, "lease_lost")
    assert decision.mark_unreachable and decision.breaker is Outcome.IGNORE


def test_a_draining_worker_hands_the_stream_on_without_a_fault():
    decision = decide(failure(worker_answer(Draining("draining")), sent=6, this_attempt=6), Budget())
    assert (decision.action, decision.reason) == (Action.RESUME, "drained")
    assert decision.breaker is Outcome.IGNORE and not decision.rollout_fault and not decision.mark_unreachable


def test_a_stream_that_ended_early_is_a_worker_fault():
    decision = decide(failure(StreamEndedEarly("no finished event"), sent=1, this_attempt=1), Budget())
    assert decision.action is Action.RESUME and decision.breaker is Outcome.FAULT


def test_a_passed_deadline_fails_at_once_without_asking_the_budget():
    budget = Budget()
    decision = decide(failure(CONNECTION_LOST, sent=3, deadline_passed=True), budget)
    assert decision.action is Action.FAIL and isinstance(decision.error, DeadlineExceeded)
    assert decision.mark_unreachable  # the worker is still gone for everyone else
    assert budget.asked == 0
    decision = decide(failure(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "late")), budget)
    assert isinstance(decision.error, DeadlineExceeded) and budget.asked == 0


def test_a_status_no_other_worker_would_change_fails_with_the_workers_answer():
    budget = Budget()
    decision = decide(failure(rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "no")), budget)
    assert decision.action is Action.FAIL and isinstance(decision.error, Unavailable)
    assert budget.asked == 0


def test_a_spent_budget_fails_with_retry_budget_exhausted():
    decision = decide(failure(CONNECTION_LOST, sent=2), Budget(Refusal.BUDGET))
    assert decision.action is Action.FAIL and isinstance(decision.error, RetryBudgetExhausted)
    # The loss is still the worker's: it is marked whatever the client gets.
    assert decision.mark_unreachable


def test_the_last_allowed_attempt_fails_with_what_the_worker_said():
    decision = decide(failure(worker_answer(Draining("draining")), sent=2), Budget(Refusal.MAX_ATTEMPTS))
    assert decision.action is Action.FAIL and isinstance(decision.error, Unavailable)
    stalled = StreamStalled(2.0, 2)
    decision = decide(failure(stalled, sent=2), Budget(Refusal.MAX_ATTEMPTS))
    assert decision.action is Action.FAIL and decision.error is stalled


def test_a_stall_on_a_worker_that_kept_streaming_to_others_does_not_implicate_the_request():
    """Overloaded, not wedged: a long queue keeps this request waiting for its first token
    while the worker streams to others. The stream still moves; the request is not suspect."""
    stalled = StreamStalled(10.0, 0)
    busy = dataclasses.replace(failure(stalled, sent=0, this_attempt=0, accepted=True), worker_silent=False)
    decision = decide(busy, Budget())
    assert decision.action is Action.RETRY and decision.implication is Implication.NONE
    silent = decide(failure(stalled, sent=0, this_attempt=0, accepted=True), Budget())
    assert silent.implication is Implication.TAKEN_ON


def test_a_lease_lost_by_a_worker_that_kept_streaming_does_not_implicate_the_request():
    """The worker's keep-alive starved (an overload, an etcd election) while it served: its
    lease lapsing is not the doing of the requests in its prefill. A frozen worker is silent."""
    lapsed = WorkerLeaseLost("gone")
    busy = dataclasses.replace(failure(lapsed, sent=0, this_attempt=0, accepted=True), worker_silent=False)
    decision = decide(busy, Budget())
    assert decision.action is Action.RETRY and decision.implication is Implication.NONE
    assert decision.mark_unreachable  # still gone from routing until etcd has it again
    frozen = decide(failure(lapsed, sent=0, this_attempt=0, accepted=True), Budget())
    assert frozen.implication is Implication.TAKEN_ON


def test_worker_progress_reads_a_lapsed_lease_against_the_quiet_of_a_frozen_worker():
    clock = FakeClock(100.0)
    progress = WorkerProgress(clock=clock, lease_quiet_s=lease_quiet_s(3, 1.0))
    lapsed = WorkerLeaseLost("gone")
    assert progress.silent("w1", lapsed)  # never heard from
    progress.streamed("w1")
    clock.advance(1.5)
    assert not progress.silent("w1", lapsed)  # relayed within the last two seconds: it was alive
    clock.advance(1.0)
    assert progress.silent("w1", lapsed)
    assert lease_quiet_s(3, 3.0) == 0.5


def test_worker_progress_tells_a_silent_worker_from_a_busy_one():
    clock = FakeClock(100.0)
    progress = WorkerProgress(max_workers=2, clock=clock)
    stalled = StreamStalled(10.0, 0)
    assert progress.silent("w1", stalled)  # never heard from
    progress.streamed("w1")
    clock.advance(9.0)
    assert not progress.silent("w1", stalled)  # streamed to someone within the window
    clock.advance(2.0)
    assert progress.silent("w1", stalled)
    assert progress.silent("w1", CONNECTION_LOST)  # only a stall needs telling apart
    progress.streamed("w2")
    progress.streamed("w3")  # over max_workers: the stalest (w1) is forgotten
    assert progress.silent("w1", StreamStalled(1000.0, 0))
    assert not progress.silent("w3", stalled)


def test_an_engine_that_reported_moving_is_not_silent_though_it_relayed_nothing_here():
    """A worker busy prefilling (a burst it took over, a long prompt) relays no token to this
    router, but its engine's steps come over the Relay stream: a stall in that window is not a
    wedged worker. The report counts only from late in the window (`engine_quiet_s`): an
    engine that moved early on and has stood still since is wedged, by the waiting request as
    likely as by anything."""
    clock = FakeClock(100.0)
    progress = WorkerProgress(clock=clock, engine_quiet_s=5.0)
    stalled = StreamStalled(10.0, 0)
    assert progress.silent("w1", stalled, engine_moved_at=None)
    assert not progress.silent("w1", stalled, engine_moved_at=clock() - 3.0)
    assert progress.silent("w1", stalled, engine_moved_at=clock() - 6.0)  # in the window, but still since
    assert progress.silent("w1", stalled, engine_moved_at=clock() - 11.0)
    progress.streamed("w1")
    clock.advance(12.0)
    # The later of the two is what counts: an old report does not hide a recent silence.
    assert not progress.silent("w1", stalled, engine_moved_at=clock() - 1.0)
    assert progress.silent("w1", stalled, engine_moved_at=clock() - 20.0)
    lapsed = WorkerLeaseLost("gone")
    quiet = WorkerProgress(clock=clock, lease_quiet_s=2.0, engine_quiet_s=5.0)  # the shorter of the two
    assert not quiet.silent("w1", lapsed, engine_moved_at=clock() - 1.0)
    assert quiet.silent("w1", lapsed, engine_moved_at=clock() - 3.0)
    assert quiet.silent("w1", CONNECTION_LOST, engine_moved_at=clock())  # a dead connection is dead
