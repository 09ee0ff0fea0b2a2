"""Building blocks every Ballast gRPC server shares: the error and tracing interceptors, health,
reflection, and (with `tls.enabled`) the peer-role check and TLS ports of `services.common.tls`.

Core code raises the typed errors of `services.common.errors`; `DomainErrorInterceptor` is
the one place they become gRPC status codes. Anything else escaping a handler is a bug and
becomes INTERNAL (logged with its traceback).

A request frame that does not parse as its message type (a string field that is not UTF-8
among them) is the client's fault: it gets INVALID_ARGUMENT with the `ballast-reason` trailer
of every refusal, reaches no handler and writes no log line (gRPC itself would answer UNKNOWN
and log a traceback per frame, so garbage could fill a disk); `malformed_requests()` counts
them for metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import BallastError, InvalidArgument
from services.common.faults import status_trailers
from services.common.grpc_tracing import TracingServerInterceptor
from services.common.tls.interceptor import PeerRoleInterceptor
from services.common.tls.roles import HEALTH_ONLY
from services.common.tls.settings import TLSConfig

log = logging.getLogger(__name__)

# Large enough for a tokenizer.json in ModelInfo; requests are bounded separately.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Clients ping idle channels (see CHANNEL_OPTIONS) to notice dead peers; accept that
    # instead of answering GOAWAY "too_many_pings".
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
# How long, and how many frames, a refused client stream is read on before its status goes out.
DRAIN_LIMIT_S = 2.0
DRAIN_MAX_FRAMES = 256
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Notice a dead peer quickly even when no message is due.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


async def abort_with(context: grpc.aio.ServicerContext, error: BallastError) -> None:
    """Ends the call with the error's status, its fault and any retry hint in the trailers."""
    context.set_trailing_metadata(status_trailers(error))
    await context.abort(error.code, error.message)


class MalformedRequest:
    """Stands in for a request frame that did not parse; the handler refuses it."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


_malformed = 0


def malformed_requests() -> int:
    """Request frames refused because they did not parse, since the process started."""
    return _malformed


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    type_name = getattr(getattr(deserializer, "__self__", None), "__name__", "the request message")

    def parse(data: bytes) -> Any:
        global _malformed
        try:
            return deserializer(data)
        except DecodeError:
            _malformed += 1
            return MalformedRequest(type_name)

    return parse


async def _refuse_malformed(request, context) -> None:
    # Like every other refusal: the status and its reason trailer, so a client tells bad
    # input from a failing server by type.
    await abort_with(context, InvalidArgument(f"the request frame does not parse as {request.type_name}"))


@contextlib.asynccontextmanager
async def _statuses(context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
    """Typed errors become their status; anything else escaping a handler is a bug: INTERNAL,
    logged with its traceback."""
    try:
        yield
    except BallastError as error:
        await abort_with(context, error)
    except (grpc.aio.AbortError, grpc.aio.UsageError):
        raise
    except Exception:
        log.exception("bug in %s", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}")


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str):
    async def wrapper(request, context):
        if isinstance(request, MalformedRequest):
            await _refuse_malformed(request, context)
        async with _statuses(context, method):
            return await behavior(request, context)

    return wrapper


def _wrap_stream(behavior: Callable[..., Any], method: str):
    async def wrapper(request, context):
        if isinstance(request, MalformedRequest):
            await _refuse_malformed(request, context)
        async with _statuses(context, method):
            replies = behavior(request, context)
            if inspect.isawaitable(replies):
                # A handler that writes its replies itself (context.write), as gRPC's health
                # Watch does, rather than yielding them.
                await replies
                return
            async for item in replies:
                yield item

    return wrapper


async def _parsed(request_iterator: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream's requests; a frame that does not parse ends it as bad input, wherever it comes."""
    async for request in request_iterator:
        if isinstance(request, MalformedRequest):
            raise InvalidArgument(f"a request frame does not parse as {request.type_name}")
        yield request


def _wrap_client_stream(behavior: Callable[..., Awaitable[Any]], method: str):
    async def wrapper(request_iterator, context):
        async with _statuses(context, method):
            try:
                return await behavior(_parsed(request_iterator), context)
            except BallastError:
                # The client may still be writing (megabytes of KV blocks): answering before
                # it finishes races its writes in gRPC's transport, and it can then see
                # INTERNAL "Internal error from Core" instead of our status. Read the rest
                # first, bounded.
                await _drain(request_iterator, context)
                raise

    return wrapper


def _wrap_bidi(behavior: Callable[..., Any], method: str):
    """A bidirectional handler that yields its answers (as every Ballast one does: the TLS
    peer check wraps handlers the same way)."""

    async def wrapper(request_iterator, context):
        async with _statuses(context, method):
            try:
                async for item in behavior(_parsed(request_iterator), context):
                    yield item
            except BallastError:
                # As for a client stream: a status sent while the client still writes (the
                # frames after a malformed one) races its writes, and it can see INTERNAL
                # "Internal error from Core" instead. Read the rest first, bounded.
                await _drain(request_iterator, context)
                raise

    return wrapper


async def _drain(request_iterator, context: grpc.aio.ServicerContext) -> None:
    """Reads and drops what is left of a refused client stream, for at most DRAIN_LIMIT_S
    (less when the call's deadline is nearer) and DRAIN_MAX_FRAMES frames."""
    remaining = context.time_remaining()
    limit = DRAIN_LIMIT_S if remaining is None else min(DRAIN_LIMIT_S, max(0.0, remaining - 0.05))
    frames = 0

    async def read_rest() -> None:
        nonlocal frames
        async for _ in request_iterator:
            frames += 1
            if frames >= DRAIN_MAX_FRAMES:
                return

    try:
        await asyncio.wait_for(read_rest(), limit)
    except Exception:
        # Whatever stops the reading (time, a broken stream), the status still goes out.
        pass


class DomainErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps typed domain errors to status codes for every call shape, and refuses request
    frames that do not parse."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_client_stream(handler.stream_unary, method),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_bidi(handler.stream_stream, method),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler


def new_server(
    interceptors: list[grpc.aio.ServerInterceptor] | None = None,
    tls: TLSConfig | None = None,
    plaintext_services: frozenset[str] = HEALTH_ONLY,
    reuse_port: bool = False,
) -> grpc.aio.Server:
    """A server with the shared interceptors; with `tls` enabled, calls are checked
    against the peer's role (services.common.tls.roles), and a call that came without TLS
    reaches only `plaintext_services`. `reuse_port`: other processes of the same service may
    listen on its ports (SO_REUSEPORT); off, a port taken by anyone else fails to bind."""
    # Tracing outermost: its span covers the error mapping and sees the final status code.
    shared: list[grpc.aio.ServerInterceptor] = [TracingServerInterceptor(), DomainErrorInterceptor()]
    if tls is not None and tls.enabled:
        shared.append(PeerRoleInterceptor(plaintext_services))
    options = [(key, int(reuse_port) if key == "grpc.so_reuseport" else value) for key, value in SERVER_OPTIONS]
    return grpc.aio.server(interceptors=[*shared, *(interceptors or [])], options=options)


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Serves grpc.health.v1 (overall "" and each service) and server reflection."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


async def set_serving(health_servicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


def bind_health_port(server: grpc.aio.Server, host: str, tls: TLSConfig) -> int | None:
    """With TLS on and `tls.health_port` set, binds that port in plaintext (the server's role
    check lets only health checks through there); returns the port bound, or None."""
    if not tls.enabled or tls.health_port is None:
        return None
    return bind(server, host, tls.health_port)


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Binds a port (port 0 picks one), TLS with `credentials`, else plaintext; returns the port bound."""
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound
