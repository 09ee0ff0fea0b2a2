"""W3C trace context over gRPC: a client interceptor that sends it, a server interceptor that
continues it in a server span named after the method (`ballast.v1.Worker/Generate`).

Small and explicit on purpose: the span of each hop is the parent of the next one's, whatever
the call shape (unary or streaming either way). Health checks and reflection are not traced:
probes every second would bury the requests.
"""

from __future__ import annotations

import asyncio
import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from services.common.tracing import PROPAGATOR, context_from_metadata, tracer

UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.")
# Calls that carry many requests for as long as the connection lives: each request gets a span
# of its own from the trace context it brings (services.worker.relay), not the call.
UNTRACED_METHODS = ("ballast.v1.Worker/Relay",)
# Server-side codes that mean the server failed (OpenTelemetry's gRPC conventions); the others
# (bad input, not found, overload...) are the caller's outcome, not an error of this span.
SERVER_ERROR_CODES = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
}
_TRACER = tracer("grpc")


def _traced(method: str) -> bool:
    name = method.lstrip("/")
    return not name.startswith(UNTRACED_SERVICES) and name not in UNTRACED_METHODS


# --- client ---------------------------------------------------------------------------------


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    # The interceptor runs in a task created with the caller's context: the current span is
    # the caller's span at the moment it made the call.
    PROPAGATOR.inject(carrier)
    if not carrier:
        return details
    metadata = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()))
    for key, value in carrier.items():
        metadata[key] = value
    return details._replace(metadata=metadata)


# grpc.aio files an interceptor under the first call shape it implements only, so each shape
# needs a class of its own.
class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_context(client_call_details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_context(client_call_details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """What every channel to another Ballast service passes as `interceptors=`: each call sends
    the `traceparent` (and `tracestate`) of the span current when it was made."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]


def unary_client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """For a channel whose response-streaming calls send `trace_metadata()` themselves: only
    the unary-response shapes are intercepted. grpc.aio runs an intercepted streaming call
    through an extra task and hands every response message through one more generator: on
    the router's worker streams that is a cost per relayed token, for a header that is
    sent once."""
    return [_UnaryUnary(), _StreamUnary()]


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The `traceparent` (and `tracestate`) of the current span, as call metadata."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    return tuple(carrier.items())


# --- server ---------------------------------------------------------------------------------


def _status_code(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if error is None:
        return grpc.StatusCode.OK
    # GeneratorExit: a stream closed while it waited to send, because its caller went away.
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


@contextmanager
def _server_span(method: str, context: grpc.aio.ServicerContext) -> Iterator[otel_context.Context]:
    """The call's server span, ended (with the call's status) on exit; yields the context that
    makes it current. Callers attach that context only around steps that never suspend across
    another task's turn (see `_attached`)."""
    service, _, name = method.lstrip("/").rpartition("/")
    parent = context_from_metadata(context.invocation_metadata())
    span = _TRACER.start_span(
        method.lstrip("/"),
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
    )
    error: BaseException | None = None
    try:
        yield set_span_in_context(span, parent)
    except BaseException as exc:
        error = exc
        raise
    finally:
        code = _status_code(context, error)
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code in SERVER_ERROR_CODES:
            if error is not None and not isinstance(error, (grpc.aio.AbortError, asyncio.CancelledError)):
                span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {context.details() or ''}".rstrip(": ")))
        span.end()


@contextmanager
def _attached(span_context: otel_context.Context) -> Iterator[None]:
    """Makes the span current for one step. A streaming handler's steps may run in different
    asyncio contexts (gRPC closes a cancelled stream from another task), and a context token
    can only be detached in the context that attached it: one token per step never crosses."""
    token = otel_context.attach(span_context)
    try:
        yield
    finally:
        otel_context.detach(token)


def _unary_response(behavior, method: str):
    async def traced(request_or_iterator, context):
        with _server_span(method, context) as span_context, _attached(span_context):
            return await behavior(request_or_iterator, context)

    return traced


def _stream_response(behavior, method: str):
    async def traced(request_or_iterator, context):
        with _server_span(method, context) as span_context:
            with _attached(span_context):
                result: Any = behavior(request_or_iterator, context)
            if inspect.isasyncgen(result):
                try:
                    while True:
                        with _attached(span_context):
                            try:
                                item = await result.__anext__()
                            except StopAsyncIteration:
                                break
                        yield item
                finally:
                    # Closed now, not whenever it is garbage collected: when the call is
                    # cancelled, the handler's own cleanup (its slot, its engine sequence) must
                    # run at once.
                    with _attached(span_context):
                        await result.aclose()
            else:  # a handler that writes with context.write() and returns nothing
                with _attached(span_context):
                    await result

    return traced


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """Continues the caller's trace (or starts one) in a server span around each call."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not _traced(method):
            return handler
        kinds = (
            (handler.unary_unary, grpc.unary_unary_rpc_method_handler, _unary_response),
            (handler.unary_stream, grpc.unary_stream_rpc_method_handler, _stream_response),
            (handler.stream_unary, grpc.stream_unary_rpc_method_handler, _unary_response),
            (handler.stream_stream, grpc.stream_stream_rpc_method_handler, _stream_response),
        )
        for behavior, make_handler, wrap in kinds:
            if behavior is not None:
                return make_handler(
                    wrap(behavior, method),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler
