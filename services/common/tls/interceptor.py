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
    # Whether the request is one message or a stream, the check comes first; only the
    # response side differs: one awaited reply, or a stream to pass on.
    def single(inner):
        async def behavior(request_or_iterator, context):
            await _refuse_unless_allowed(context, method, allowed)
            return await inner(request_or_iterator, context)

        return behavior

    def streaming(inner):
        async def behavior(request_or_iterator, context):
            await _refuse_unless_allowed(context, method, allowed)
            async for item in inner(request_or_iterator, context):
                yield item

        return behavior

    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(single(handler.unary_unary), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(single(handler.stream_unary), **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kwargs)


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
