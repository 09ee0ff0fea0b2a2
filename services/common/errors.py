"""Typed domain errors. Core code raises these; one interceptor per server maps them to gRPC.

Each error says whether retrying elsewhere can help (`retriable`), which drives failover
and breakers: client errors are never retriable and never count as worker faults. Each also
names its `Fault`, which travels with the status (see `services.common.faults`), so a caller
in another process tells a draining worker from a pool without workers by type, not by text.
"""

from __future__ import annotations

import enum

import grpc


class Fault(str, enum.Enum):
    """Why a call failed; the value is what a server sends in its status's trailing metadata."""

    INVALID_ARGUMENT = "invalid_argument"
    UNAUTHENTICATED = "unauthenticated"
    NOT_FOUND = "not_found"
    OVERLOADED = "overloaded"
    QUOTA_EXCEEDED = "quota_exceeded"
    UNAVAILABLE = "unavailable"
    NO_LIVE_WORKER = "no_live_worker"
    RETRY_BUDGET_EXHAUSTED = "retry_budget_exhausted"
    DRAINING = "draining"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    # A request that killed or stalled the workers it ran on, refused while it is quarantined.
    QUARANTINED = "quarantined"
    # The request's worker died under it (while taking it on) and no other worker could take it.
    WORKER_LOST = "worker_lost"
    # Never sent: the call failed before a Ballast server answered (refused, reset, closed).
    UNREACHABLE = "unreachable"
    # The caller's key may not do this (name another tenant in x-ballast-on-behalf-of).
    PERMISSION_DENIED = "permission_denied"
    # GetAnswer: no better answer for the ticket yet (or none of the caller's).
    BACKFILL_PENDING = "backfill_pending"
    # GetAnswer: the answer was kept for backfill.answer_retention_s and then removed.
    BACKFILL_EXPIRED = "backfill_expired"
    # GetAnswer: the answer was stored and is no longer in the store (the store lost data).
    BACKFILL_LOST = "backfill_lost"


class BallastError(Exception):
    """Base of every error Ballast means to send to a caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    fault: Fault = Fault.INTERNAL
    retriable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(BallastError):
    """The request is malformed; the same request will always fail."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    fault = Fault.INVALID_ARGUMENT


class Unauthenticated(BallastError):
    """No API key, or one Ballast does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED
    fault = Fault.UNAUTHENTICATED


class NotFound(BallastError):
    """The named model (or other resource) does not exist."""

    code = grpc.StatusCode.NOT_FOUND
    fault = Fault.NOT_FOUND


class ResourceExhausted(BallastError):
    """Overload: backpressure, not a fault. Carries a hint of when to retry."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    fault = Fault.OVERLOADED
    retriable = True

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceeded(ResourceExhausted):
    """The tenant used up its requests or tokens per minute: refused until the quota refills
    (the retry hint says when), never degraded, and no sign of overload."""

    fault = Fault.QUOTA_EXCEEDED


class Unavailable(BallastError):
    """No replica can serve right now; another one (or a later try) may."""

    code = grpc.StatusCode.UNAVAILABLE
    fault = Fault.UNAVAILABLE
    retriable = True


class NoLiveWorker(Unavailable):
    """The pool has no routable worker (none registered, or all out: breakers, heat, draining)."""

    fault = Fault.NO_LIVE_WORKER


class RetryBudgetExhausted(Unavailable):
    """No retry allowed now: the budget is spent or the request used its attempts."""

    fault = Fault.RETRY_BUDGET_EXHAUSTED


class WorkerLost(Unavailable):
    """The worker died or stalled while taking this request on, and no other worker is left to
    try. Unlike NoLiveWorker it says the request may be why: a replay that ends so counts as a
    failed attempt."""

    fault = Fault.WORKER_LOST


class Quarantined(BallastError):
    """The request (by its fingerprint: tenant, input and schema) killed or stalled the workers
    it ran on and is refused until its quarantine lapses (`retry_after_s`). FAILED_PRECONDITION:
    the same request cannot succeed by retrying, the caller is not at fault for sending it, and
    neither failover, the breakers nor the degradation ladder act on it."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    fault = Fault.QUARANTINED

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Draining(Unavailable):
    """The worker is draining (stopping): it takes no new work and hands open streams back."""

    fault = Fault.DRAINING


class DeadlineExceeded(BallastError):
    """The caller's deadline passed before the work finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    fault = Fault.DEADLINE_EXCEEDED


class Cancelled(BallastError):
    """The work was cancelled (caller went away, or the server is shutting down)."""

    code = grpc.StatusCode.CANCELLED
    fault = Fault.CANCELLED


class PermissionDenied(BallastError):
    """The caller is known but its key may not do what it asked (run as another tenant)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    fault = Fault.PERMISSION_DENIED


class BackfillPending(NotFound):
    """No better answer for the ticket yet: it may still come."""

    fault = Fault.BACKFILL_PENDING


class BackfillExpired(NotFound):
    """The better answer was kept for its retention and removed: it will not come again."""

    fault = Fault.BACKFILL_EXPIRED


class BackfillLost(BallastError):
    """The better answer was stored and the store no longer has it: it will not come."""

    code = grpc.StatusCode.DATA_LOSS
    fault = Fault.BACKFILL_LOST
