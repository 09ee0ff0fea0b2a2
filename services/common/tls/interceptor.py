"""The server interceptor that enforces `roles.RULES`: a call from a peer whose certificate
names a role the method does not accept ends PERMISSION_DENIED before its handler runs.

gRPC hands interceptors the method name but not the peer, so the check wraps the handler and
reads `context.auth_context()` when the call starts.
"""

from __future__ import annotations

import logging

import grpc

from services.common.tls.roles import ANY_PEER, allowed_roles, peer_role, service_of

log = logging.getLogger(__name__)


async def _refuse_unless_allowed(context: grpc.aio.ServicerContext, method: str, allowed: frozenset[str]) -> None:
    role = peer_role(context.auth_context())
    if role not in allowed:
        log.info("refused %s to a peer with role %s", method, role or "(none)")
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"a {role or 'peer without a Ballast role'} may not call {service_of(method)}")


def _guard(handler: grpc.RpcMethodHandler, method: str, allowed: frozenset[str]) -> grpc.RpcMethodHandler:
    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            await _refuse_unless_allowed(context, method, allowed)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            await _refuse_unless_allowed(context, method, allowed)
            async for item in inner_us(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests, context):
            await _refuse_unless_allowed(context, method, allowed)
            return await inner_su(requests, context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
    inner_ss = handler.stream_stream

    async def stream_stream(requests, context):
        await _refuse_unless_allowed(context, method, allowed)
        async for item in inner_ss(requests, context):
            yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)


class PeerRoleInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only when the peer's role may call its service."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        allowed = allowed_roles(method)
        if allowed is ANY_PEER:
            return handler
        return _guard(handler, method, allowed)
