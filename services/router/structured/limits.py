"""The `router.limits` section: what one request may cost the router and its workers.

The router refuses a request over any of these with InvalidArgument naming the limit, before
it is queued or sent to a worker: a schema's bounds (the shared `SchemaLimits`, which workers
apply again before compiling a grammar), the number of messages and each message's size
(the whole prompt is `router.max_prompt_chars`, the whole request `router.max_request_bytes`).
"""

from __future__ import annotations

from typing import Sequence

import msgspec
from pydantic import Field

from services.common.config import Section
from services.common.errors import InvalidArgument
from services.common.schema_limits import SchemaLimits


class RequestLimits(Section):
    max_messages: int = Field(2048, ge=1, description="Most messages in one conversation.")
    max_message_chars: int = Field(100_000, ge=1, description="Longest single message (characters).")
    json_schema: SchemaLimits = Field(
        default_factory=SchemaLimits,
        description="Bounds on a response_format JSON Schema (size, depth, counts, enums, patterns, formats).",
    )


def check_message_count(count: int, limits: RequestLimits) -> None:
    """InvalidArgument when a conversation has more messages than the limit."""
    if count > limits.max_messages:
        raise InvalidArgument(
            f"conversation has {count} messages; the limit is {limits.max_messages} (router.limits.max_messages)"
        )


def check_message_sizes(contents: Sequence[str], limits: RequestLimits) -> None:
    """InvalidArgument when one message is longer than the limit; `contents` are the
    messages' texts in order."""
    for i, content in enumerate(contents):
        if len(content) > limits.max_message_chars:
            raise InvalidArgument(
                f"conversation.messages[{i}].content is {len(content)} characters; the limit is "
                f"{limits.max_message_chars} (router.limits.max_message_chars)"
            )


class _ChatBody(msgspec.Struct):
    messages: list[msgspec.Raw] | None = None


_CHAT_BODY = msgspec.json.Decoder(_ChatBody)


def check_chat_body(raw: bytes, limits: RequestLimits) -> None:
    """InvalidArgument when an OpenAI chat body (JSON bytes) holds more messages than the limit,
    counted by a scan that builds none of them: json.loads of 10^5 small messages takes one
    GIL-holding call of a few hundred ms, this about a tenth of that. A body the scan cannot
    read (not JSON, not an object, no list of messages) is left to the full parse to refuse."""
    try:
        body = _CHAT_BODY.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    if body.messages is not None:
        check_message_count(len(body.messages), limits)
