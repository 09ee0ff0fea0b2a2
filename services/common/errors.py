"""Typed domain errors. Core code raises these; one interceptor per server maps them to gRPC.

Each error says whether retrying elsewhere can help (`retriable`), which drives failover
and breakers: client errors are never retriable and never count as worker faults.
"""

from __future__ import annotations

import grpc


class BallastError(Exception):
    """Base of every error Ballast means to send to a caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retriable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(BallastError):
    """The request is malformed; the same request will always fail."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(BallastError):
    """No API key, or one Ballast does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class NotFound(BallastError):
    """The named model (or other resource) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(BallastError):
    """Overload: backpressure, not a fault. Carries a hint of when to retry."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retriable = True

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(BallastError):
    """No replica can serve right now; another one (or a later try) may."""

    code = grpc.StatusCode.UNAVAILABLE
    retriable = True


class DeadlineExceeded(BallastError):
    """The caller's deadline passed before the work finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(BallastError):
    """The work was cancelled (caller went away, or the server is shutting down)."""

    code = grpc.StatusCode.CANCELLED
