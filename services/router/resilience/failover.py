"""What the router does when a worker call ends without an answer, decided in one pure function.

The generation runner describes whatever ended an attempt as an `AttemptFailure` (the error,
the tokens the request and this attempt had delivered, whether the worker had taken the call
on) and applies the `FailoverDecision` that `decide` returns: pause (preempted), retry (nothing
sent yet) or resume (tokens sent) on another worker, or fail with the error the client gets;
and beside it what the worker's breaker records, whether the worker is marked unreachable,
whether the loss counts against the request (quarantine) and against its rollout version.

Nothing here touches a breaker, a budget, a slot or a metric: the decision is data, and the
only state it reads, the request's retry budget, is asked through a callable, so every path
is unit-tested without servers.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace
from typing import Callable

import grpc

from services.common.errors import (
    BallastError,
    DeadlineExceeded,
    Fault,
    InvalidArgument,
    ResourceExhausted,
    RetryBudgetExhausted,
    Unavailable,
)
from services.common.faults import classify
from services.router.resilience.breaker import Outcome, is_connection_lost, outcome_of
from services.router.resilience.quarantine import DEFAULT_ENGINE_QUIET_S, Implication, implication
from services.router.resilience.retry_budget import Refusal
from services.router.resilience.stall import StreamStalled

# Codes after which the same request may succeed on another worker.
RETRIABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,  # the worker's server went away under the call
    }
)


class StreamEndedEarly(Unavailable):
    """The worker closed the stream without a finished event."""


class WorkerLeaseLost(Unavailable):
    """The worker's etcd record disappeared while it was streaming."""


# How long, at the least, a worker that froze (its event loop stuck: a query of death in the
# grammar compiler, a hung engine call) has relayed nothing when its lease lapses: the lease's
# TTL less one heartbeat, since it last kept the lease alive at most a heartbeat before it
# froze (etcd's defaults: 3 s less 1 s). A worker that relayed a token more recently was not
# frozen: its lease lapsed for another reason (its machine starved of CPU, an etcd election).
DEFAULT_LEASE_QUIET_S = 2.0


def lease_quiet_s(lease_ttl_s: float, heartbeat_s: float) -> float:
    """The quiet a frozen worker has at the least when its lease lapses (see
    DEFAULT_LEASE_QUIET_S), for the workers' etcd settings; half a second at the least, so that
    a heartbeat set as long as the TTL does not leave every lapse unexplained."""
    return max(lease_ttl_s - heartbeat_s, 0.5)


class Preempted(Exception):
    """The scheduler took this stream's slot for a higher tier; it resumes when a slot frees."""


# What ends an attempt that `decide` has a say on; anything else (the client gone, a bug)
# propagates as it is.
DECIDED_ERRORS = (Preempted, InvalidArgument, grpc.aio.AioRpcError, Unavailable)


class Action(str, enum.Enum):
    # Preempted: give the slot up, wait for another, continue from what was sent.
    PAUSE = "pause"
    # Nothing sent yet: the same request on another worker.
    RETRY = "retry"
    # Tokens sent: continue from them on another worker (the client sees a Resumed event).
    RESUME = "resume"
    # The client gets `FailoverDecision.error`.
    FAIL = "fail"


@dataclass(frozen=True)
class AttemptFailure:
    """How one attempt on a worker ended without its answer."""

    error: BaseException
    worker_id: str
    # Tokens the request has delivered in all, and in this attempt.
    tokens_sent: int
    tokens_this_attempt: int
    # The worker had taken the call on (its `ballast-accepted` metadata came) before it was lost.
    accepted: bool
    # The client's deadline had passed when the attempt ended.
    deadline_passed: bool
    # The worker relayed no token for any stream during this attempt's stall window (or, for a
    # lost lease, the quiet a frozen worker has at the least), nor said that its engine moved
    # late in it (WorkerProgress.silent). A worker that kept streaming to others, or whose
    # engine kept computing (a long or queued prefill), while this stream waited is slow
    # (overloaded, a long queue), not wedged: its stall or its lapsed lease says nothing
    # against the request.
    worker_silent: bool = True
    # The attempt asked its worker to wait for this router's confirm of its accepted event
    # before the engine saw the request (a Relay call after a failed attempt, or of a request
    # that already cost a worker).
    confirm_asked: bool = False
    # The worker was lost while this attempt waited in its line behind a full prefill batch
    # (see RouterQuarantine.queued): the engine had most likely not begun it.
    queued: bool = False


@dataclass(frozen=True)
class FailoverDecision:
    action: Action
    # Why the stream moved ("preempted", "worker_lost", "stalled", "lease_lost", "drained"),
    # the label of the resume metrics and the Resumed event.
    reason: str
    # What the worker's breaker records for this attempt.
    breaker: Outcome
    # The worker is gone for every request, not just this one: no new work for it until etcd
    # replaces or drops it.
    mark_unreachable: bool = False
    # Whether the loss counts against the request (quarantine), and how sure it is.
    implication: Implication = Implication.NONE
    # The request waited behind a full prefill batch (AttemptFailure.queued): the quarantine
    # may excuse the loss.
    queued: bool = False
    # The attempt is a fault of the worker's model version (rollout judgement).
    rollout_fault: bool = False
    # For FAIL: what the client gets.
    error: BaseException | None = None


class WorkerProgress:
    """When each worker last relayed a token to this router (any stream), so that a stalled
    stream, or a lease lost, can tell a wedged worker (silent for everyone) from a slow one,
    with the worker's own word that its engine moved (see `silent`).
    One entry per worker id seen, the stalest forgotten past `max_workers`. `clock`: monotonic
    seconds (the clock of RelayLink.engine_moved_at); `lease_quiet_s`: see
    DEFAULT_LEASE_QUIET_S; `engine_quiet_s`: see QuarantineConfig.engine_quiet_s."""

    def __init__(
        self,
        max_workers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        lease_quiet_s: float = DEFAULT_LEASE_QUIET_S,
        engine_quiet_s: float = DEFAULT_ENGINE_QUIET_S,
    ) -> None:
        self._last: dict[str, float] = {}
        self._max = max_workers
        self._clock = clock
        self._lease_quiet_s = lease_quiet_s
        self._engine_quiet_s = engine_quiet_s

    def last_token_at(self, worker_id: str) -> float | None:
        """When `worker_id` last relayed a token to this router (monotonic; None: not seen)."""
        return self._last.get(worker_id)

    def streamed(self, worker_id: str) -> None:
        """A token message came from `worker_id` (called per message: kept to a dict write)."""
        last = self._last
        last[worker_id] = self._clock()
        if len(last) > self._max:  # rare: only past max_workers ids
            del last[min(last, key=last.__getitem__)]

    def silent(self, worker_id: str, error: BaseException, engine_moved_at: float | None = None) -> bool:
        """Whether `worker_id` relayed nothing during the window of `error` (a stall's
        timeout, or for a lost lease the quiet a frozen worker has at the least), nor said that
        its engine moved in the last `engine_quiet_s` of it (`engine_moved_at`, on this object's
        clock: the worker's last report that its engine computed steps while it had no token
        for this router, as an engine busy prefilling does). A report from early in the window
        says nothing of an engine wedged since (by the very request that waited). True for any
        other error: a dead connection needs no telling apart."""
        if isinstance(error, StreamStalled):
            window = error.timeout_s
        elif isinstance(error, WorkerLeaseLost):
            window = self._lease_quiet_s
        else:
            return True
        now = self._clock()
        last = self._last.get(worker_id)
        if last is not None and last >= now - window:
            return False
        return engine_moved_at is None or engine_moved_at < now - min(window, self._engine_quiet_s)


BudgetAsk = Callable[[], Refusal | None]
"""Asks the request's retry budget for one more attempt: None when granted, else why not."""


def worker_gone(error: BaseException) -> bool:
    """The call failed because its worker is gone (process dead, connection lost, lease
    expired), not because a live worker answered with an error."""
    return is_connection_lost(error) or isinstance(error, WorkerLeaseLost)


def worker_died(error: BaseException, silent: bool = True) -> bool:
    """The worker's connection is lost, or it stalled or lost its lease while silent for every
    stream and its engine still (`silent`): if it had taken the request on, the request may be
    why. A worker that
    kept streaming to others until its lease lapsed was alive and serving: the lease went for
    want of CPU or etcd, and every request on it would be implicated for nothing (under an
    overload that starves the workers' keep-alives, the most popular prompt is on all of them)."""
    if isinstance(error, (StreamStalled, WorkerLeaseLost)):
        return silent
    return worker_gone(error)


def resume_reason(error: BaseException) -> str:
    if isinstance(error, Preempted):
        return "preempted"
    if isinstance(error, StreamStalled):
        return "stalled"
    if isinstance(error, WorkerLeaseLost):
        return "lease_lost"
    failure = classify(error)
    if failure is not None and failure.fault is Fault.DRAINING:
        return "drained"
    return "worker_lost"


def error_from_worker(exc: grpc.aio.AioRpcError, worker_id: str) -> BallastError:
    """The Ballast error a client gets for a worker's gRPC status."""
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(exc.details() or "invalid request")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded("deadline exceeded while generating")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(f"worker {worker_id} is full", retry_after_s=0.5)
    return Unavailable(f"worker {worker_id} failed: {code.name}: {exc.details()}")


def decide(failure: AttemptFailure, ask_budget: BudgetAsk) -> FailoverDecision:
    """What to do after `failure`; `ask_budget` is called only when another attempt is allowed
    by everything else (it spends the budget when it grants)."""
    error = failure.error
    if isinstance(error, Preempted):
        return FailoverDecision(Action.PAUSE, "preempted", Outcome.IGNORE)
    if isinstance(error, InvalidArgument):
        # Bad input: any worker would answer the same, and it says nothing about this one.
        return FailoverDecision(Action.FAIL, "invalid_argument", Outcome.IGNORE, error=error)
    reason = resume_reason(error)
    # A draining worker hands its streams on by plan (a rollout, a scale-in): not a fault.
    outcome = Outcome.IGNORE if reason == "drained" else outcome_of(error)
    lost = worker_gone(error)
    decision = FailoverDecision(
        Action.RESUME if failure.tokens_sent else Action.RETRY,
        reason,
        # A worker that is gone is not judged by its breaker: the breaker is per worker id and
        # would keep the restarted process (a new lease, back in half a second under its
        # keeper) out for a whole cool-down. The dead incarnation is marked unreachable instead.
        breaker=Outcome.IGNORE if lost else outcome,
        mark_unreachable=lost,
        implication=implication(
            worker_died(error, failure.worker_silent),
            failure.tokens_this_attempt,
            failure.accepted,
            failure.confirm_asked,
        ),
        queued=failure.queued,
        rollout_fault=outcome is Outcome.FAULT,
    )
    refused = _refusal(failure)
    if refused is None:
        refusal = ask_budget()
        if refusal is Refusal.BUDGET:
            refused = RetryBudgetExhausted(f"retry budget spent; worker {failure.worker_id} failed: {error}")
        elif refusal is not None:
            refused = error_from_worker(error, failure.worker_id) if isinstance(error, grpc.aio.AioRpcError) else error
    if refused is not None:
        return replace(decision, action=Action.FAIL, error=refused)
    return decision


def _refusal(failure: AttemptFailure) -> BaseException | None:
    """The error the client gets when the failure itself rules out another attempt."""
    error = failure.error
    if not isinstance(error, grpc.aio.AioRpcError):
        return None
    if failure.deadline_passed or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded("deadline exceeded while generating")
    if error.code() not in RETRIABLE_CODES:
        return error_from_worker(error, failure.worker_id)
    return None
