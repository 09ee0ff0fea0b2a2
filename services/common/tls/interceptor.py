"""The server interceptor that enforces `roles.RULES`: a call from a peer whose certificate
names a role the method does not accept ends PERMISSION_DENIED before its handler runs. A call
that came without TLS (a plaintext health port) reaches only the services the server allows
in plaintext, health checks by default.

gRPC hands interceptors the method name but not the peer, so the check wraps the handler and
reads `context.auth_context()` when the call starts.
"""

from __future__ import annotations

import logging

import grpc

from services.common.tls.roles import ANY_PEER, HEALTH_ONLY, allowed_roles, peer_role, service_of

log = logging.getLogger(__name__)


def _over_tls(auth_context) -> bool:
    return b"ssl" in auth_context.get("transport_security_type", ()) or "ssl" in auth_context.get(
        "transport_security_type", ()
    )


async def _refuse_unless_allowed(
    context: grpc.aio.ServicerContext, method: str, allowed: frozenset[str] | None, plaintext_services: frozenset[str]
) -> None:
    auth = context.auth_context()
    if not _over_tls(auth):
        if service_of(method) not in plaintext_services:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"{service_of(method)} is not served without TLS on this port"
            )
        return
    if allowed is ANY_PEER:
        return
    role = peer_role(auth)
    if role not in allowed:
        log.info("refused %s to a peer with role %s", method, role or "(none)")
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"a {role or 'peer without a Ballast role'} may not call {service_of(method)}",
        )


def _guard(
    handler: grpc.RpcMethodHandler, method: str, allowed: frozenset[str] | None, plaintext_services: frozenset[str]
) -> grpc.RpcMethodHandler:
    # Whether the request is one message or a stream, the check comes first; only the
    # response side differs: one awaited reply, or a stream to pass on.
    def single(inner):
        async def behavior(request_or_iterator, context):
            await _refuse_unless_allowed(context, method, allowed, plaintext_services)
            return await inner(request_or_iterator, context)

        return behavior

    def streaming(inner):
        async def behavior(request_or_iterator, context):
            await _refuse_unless_allowed(context, method, allowed, plaintext_services)
            async for item in inner(request_or_iterator, context):
                yield item

        return behavior

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(single(handler.unary_unary), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(single(handler.stream_unary), **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kwargs)


class PeerRoleInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only when the peer's role may call its service, or, for a call
    without TLS, when its service is one of `plaintext_services`."""

    def __init__(self, plaintext_services: frozenset[str] = HEALTH_ONLY) -> None:
        self.plaintext_services = plaintext_services

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        allowed = allowed_roles(method)
        if allowed is ANY_PEER and service_of(method) in self.plaintext_services:
            return handler  # any peer, with or without TLS
        return _guard(handler, method, allowed, self.plaintext_services)
