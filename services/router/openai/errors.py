"""Errors of the HTTP front in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

A Ballast error keeps its meaning: the HTTP status follows its gRPC code (INVALID_ARGUMENT 400,
UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404, FAILED_PRECONDITION 422 (a quarantined request),
RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504) and `code` is its fault
(`overloaded`, `no_live_worker`, `quarantined`...). Overload, unavailability and a quarantine
carry `Retry-After` in whole seconds. Errors of HTTP itself (a body too large) are types here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from services.common.errors import BallastError, InvalidArgument, Quarantined, ResourceExhausted, Unavailable

STATUS_FOR_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    # A quarantined request (it killed workers): well-formed, but it will not be processed.
    grpc.StatusCode.FAILED_PRECONDITION: 422,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    # The client went away: nobody reads this status (nginx's convention).
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    504: "timeout_error",
}
# When Unavailable carries no hint of its own.
DEFAULT_RETRY_AFTER_S = 1.0


class InvalidField(InvalidArgument):
    """A request field the front cannot map; `param` names it as OpenAI's API spells it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedField(InvalidField):
    """A field of OpenAI's API that Ballast does not serve (tools, n > 1, logprobs...)."""

    def __init__(self, param: str) -> None:
        super().__init__(param, f"{param!r} is not supported by this server")


class HttpRefusal(Exception):
    """Refused by HTTP rules before the request path saw it."""

    status = 400
    code = "invalid_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BodyTooLarge(HttpRefusal):
    status = 413
    code = "body_too_large"


class NotJson(HttpRefusal):
    """The body does not parse as JSON, or nests deeper than the front reads."""

    code = "invalid_json"


class RouteNotFound(HttpRefusal):
    status = 404
    code = "unknown_url"


@dataclass(frozen=True)
class ErrorReply:
    status: int
    body: dict
    headers: dict[str, str]


def _body(message: str, status: int, param: str | None, code: str | None) -> dict:
    kind = TYPE_FOR_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def retry_after_header(seconds: float) -> str:
    """HTTP's Retry-After: whole seconds, at least one."""
    return str(max(1, math.ceil(seconds)))


def error_reply(error: BaseException) -> ErrorReply:
    """The status, OpenAI-shaped body and headers that tell a client about `error`."""
    if isinstance(error, HttpRefusal):
        return ErrorReply(error.status, _body(error.message, error.status, None, error.code), {})
    if not isinstance(error, BallastError):
        return ErrorReply(500, _body("internal error", 500, None, "internal"), {})
    status = STATUS_FOR_CODE.get(error.code, 500)
    headers: dict[str, str] = {}
    if isinstance(error, (ResourceExhausted, Quarantined)):
        headers["Retry-After"] = retry_after_header(error.retry_after_s)
    elif isinstance(error, Unavailable):
        headers["Retry-After"] = retry_after_header(getattr(error, "retry_after_s", DEFAULT_RETRY_AFTER_S))
    param = error.param if isinstance(error, InvalidField) else None
    return ErrorReply(status, _body(error.message, status, param, error.fault.value), headers)
