"""Token events that are already waiting leave as one message, on the router's gRPC edge.

The router's cost per relayed token is mostly per message: each event a client gets is a
gRPC message, an HTTP/2 frame and a `sendmsg`. The public stream runs through a `Coalescer`
(services.common.streams, as a worker's engine deltas do): the request runs ahead in its own
task and, each time the previous message has gone out, every `tokens` event that arrived
meanwhile leaves merged into one (text and ids concatenated, the first index kept). Nothing
waits to be merged: a client that keeps up gets every token as soon as it comes; when the
router or the client falls behind, messages get fewer and larger instead of one per token.
Other events (started, resumed, finished) are never merged and keep their order.
"""

from __future__ import annotations

from ballast.v1 import common_pb2, inference_pb2


def merge_token_events(first: inference_pb2.GenerateEvent,
                       then: inference_pb2.GenerateEvent) -> inference_pb2.GenerateEvent | None:
    """One event for two consecutive `tokens` events; None for any other pair (kept apart)."""
    if not (first.HasField("tokens") and then.HasField("tokens")):
        return None
    return inference_pb2.GenerateEvent(tokens=common_pb2.Tokens(
        text=first.tokens.text + then.tokens.text,
        token_ids=[*first.tokens.token_ids, *then.tokens.token_ids],
        first_index=first.tokens.first_index,
    ))
