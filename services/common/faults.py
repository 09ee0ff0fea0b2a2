"""What a failed call says, read the same way by every caller.

A Ballast server sends each typed error's `Fault` in the trailing metadata key
`ballast-reason` (and a retry hint with RESOURCE_EXHAUSTED). `classify` reads a failure,
local (a `BallastError`) or remote (a `grpc.aio.AioRpcError`), into its status code and
fault; failover, the breakers, the degradation ladder and the backfill all decide on that.
An UNAVAILABLE that carries no fault did not come from a Ballast server: the connection
failed (refused, reset, closed under the stream), so it is `Fault.UNREACHABLE`.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from services.common.errors import BallastError, Fault, Quarantined, ResourceExhausted

# Trailing metadata of every Ballast error status: its Fault's value.
REASON_KEY = "ballast-reason"
# Trailing metadata of a RESOURCE_EXHAUSTED answer: milliseconds to wait before retrying.
RETRY_AFTER_KEY = "retry-after-ms"

# The fault of a status that came without one, by its code.
_UNNAMED = {
    grpc.StatusCode.INVALID_ARGUMENT: Fault.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED: Fault.UNAUTHENTICATED,
    grpc.StatusCode.NOT_FOUND: Fault.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Fault.OVERLOADED,
    grpc.StatusCode.UNAVAILABLE: Fault.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Fault.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED: Fault.CANCELLED,
}


@dataclass(frozen=True)
class Failure:
    """A failed call: its gRPC status code and why it failed."""

    code: grpc.StatusCode
    fault: Fault


def classify(error: BaseException | None) -> Failure | None:
    """The status code and fault of a Ballast or gRPC error; None for anything else (task
    cancellation, a closed generator, a bug), which says nothing about the callee."""
    if isinstance(error, BallastError):
        return Failure(error.code, error.fault)
    if isinstance(error, grpc.aio.AioRpcError):
        code = error.code()
        return Failure(code, _sent_fault(error) or _UNNAMED.get(code, Fault.INTERNAL))
    return None


def _sent_fault(error: grpc.aio.AioRpcError) -> Fault | None:
    for key, value in error.trailing_metadata() or ():
        if key == REASON_KEY:
            try:
                return Fault(value)
            except ValueError:
                return None
    return None


def status_trailers(error: BallastError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a server sends with `error`: its fault, and any retry hint."""
    trailers = [(REASON_KEY, error.fault.value)]
    if isinstance(error, (ResourceExhausted, Quarantined)):
        # A retry hint any client can read, whatever its language (a quarantine's: when it lapses).
        trailers.append((RETRY_AFTER_KEY, str(int(error.retry_after_s * 1000))))
    return tuple(trailers)


def retry_after_hint(error: grpc.aio.AioRpcError) -> float | None:
    """The server's retry hint in seconds, or None when it sent none (or an unreadable one)."""
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None
