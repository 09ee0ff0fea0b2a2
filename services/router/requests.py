"""The router's view of a client request: validated once at the edge into a domain object."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import dataclass, field, replace

from ballast.v1 import inference_pb2
from services.common.errors import InvalidArgument
from services.common.generation import Sampling
from services.common.sampling_pb import sampling_from_pb
from services.common.streams import MAX_FLUSH_INTERVAL_MS
from services.common.tier import Tier, parse_tier
from services.common.tier_pb import TIER_NAMES, tier_from_pb
from services.router.context.window import ContextPolicy
from services.router.settings import RouterConfig
from services.router.structured.limits import check_message_count, check_message_sizes
from services.router.structured.schema import Schema, check_schema

ROLES = frozenset({"system", "user", "assistant"})
MAX_ID_CHARS = 128
# A request at least this big (serialized bytes), or with a schema at least this long, is
# checked on a thread: parsing, walking and meta-checking it can take more than a few ms,
# which the event loop (every other stream, the health checks) must not wait for.
OFF_LOOP_BYTES = 64 * 1024
OFF_LOOP_SCHEMA_CHARS = 4 * 1024


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Signals:
    platform: str = ""
    regenerate: bool = False
    business_tag: str = ""


@dataclass(frozen=True)
class InferenceRequest:
    request_id: str
    session_id: str
    tenant: str
    model: str
    sampling: Sampling
    # AUTO until the auto-tagging rules give it one. A request built by hand with the tier's
    # text (a test) gets the Tier from __post_init__ (ValueError for an unknown one).
    tier: Tier
    messages: tuple[Message, ...] = ()
    prompt: str | None = None
    signals: Signals = field(default_factory=Signals)
    response_format: str = ""
    allow_degraded: bool = True
    # The checked JSON Schema of response_format (None without one).
    schema: Schema | None = field(default=None, compare=False)
    context_policy: ContextPolicy = ContextPolicy.ENTITY_AWARE
    max_turns: int | None = None
    # Longest the answer's tokens may be held back to go out together (0: the tier's default).
    flush_interval_ms: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", parse_tier(self.tier, "tier", auto=True))

    @property
    def prompt_chars(self) -> int:
        """Characters of the prompt, or of every message of the conversation."""
        return len(self.prompt) if self.prompt is not None else sum(len(m.content) for m in self.messages)


def derived_seed(tenant: str, request_id: str) -> int:
    """A seed for a request that set none, stable for its idempotency key.

    Every attempt at the same request (a resume on another worker, or the client retrying the
    same request_id on another router replica) then samples exactly the same tokens.
    """
    digest = hashlib.sha256(f"{tenant}\0{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def _check_id(name: str, value: str) -> str:
    if len(value) > MAX_ID_CHARS or any(ord(ch) < 32 for ch in value):
        raise InvalidArgument(f"{name} must be at most {MAX_ID_CHARS} printable characters")
    return value


async def checked_request(
    request: inference_pb2.GenerateRequest, tenant: str, config: RouterConfig
) -> InferenceRequest:
    """`request_from_pb`, on a thread when the request is big enough for its checks to hold
    the event loop (a small request is checked in place: a thread hop costs more than it)."""
    if request.ByteSize() >= OFF_LOOP_BYTES or len(request.response_format) >= OFF_LOOP_SCHEMA_CHARS:
        return await asyncio.to_thread(request_from_pb, request, tenant, config)
    return request_from_pb(request, tenant, config)


def request_from_pb(request: inference_pb2.GenerateRequest, tenant: str, config: RouterConfig) -> InferenceRequest:
    """Validates a GenerateRequest; raises InvalidArgument or NotFound naming the field."""
    size = request.ByteSize()
    if size > config.max_request_bytes:
        raise InvalidArgument(f"request is {size} bytes; the limit is {config.max_request_bytes}")
    if request.tier not in TIER_NAMES:
        raise InvalidArgument(f"unknown tier {request.tier}; use TIER_AUTO, TIER_S, TIER_A or TIER_B")
    if not request.model:
        raise InvalidArgument("model must be set")
    which = request.WhichOneof("input")
    messages: tuple[Message, ...] = ()
    prompt: str | None = None
    limits = config.limits
    if which == "conversation":
        pb_messages = request.conversation.messages
        if not pb_messages:
            raise InvalidArgument("conversation.messages must not be empty")
        # Before anything walks them: the count alone decides.
        check_message_count(len(pb_messages), limits)
        for i, message in enumerate(pb_messages):
            if message.role not in ROLES:
                raise InvalidArgument(f"conversation.messages[{i}].role must be one of {sorted(ROLES)}")
        messages = tuple(Message(m.role, m.content) for m in pb_messages)
        check_message_sizes([m.content for m in messages], limits)
        chars = sum(len(m.content) for m in messages)
    elif which == "prompt":
        if not request.prompt:
            raise InvalidArgument("prompt must not be empty")
        prompt = request.prompt
        chars = len(prompt)
    else:
        raise InvalidArgument("set either conversation or prompt")
    if chars > config.max_prompt_chars:
        raise InvalidArgument(f"prompt is {chars} characters; the limit is {config.max_prompt_chars}")
    schema = check_schema(request.response_format, limits.json_schema) if request.response_format else None
    context_policy = ContextPolicy.parse(request.context.policy)
    max_turns = request.context.max_turns if request.context.HasField("max_turns") else None
    if max_turns is not None and max_turns < 1:
        raise InvalidArgument("context.max_turns must be >= 1")
    if request.flush_interval_ms > MAX_FLUSH_INTERVAL_MS:
        raise InvalidArgument(f"flush_interval_ms must be at most {MAX_FLUSH_INTERVAL_MS}")
    sampling = sampling_from_pb(request.sampling, config.default_max_tokens, config.max_tokens_limit)
    request_id = _check_id("request_id", request.request_id) or uuid.uuid4().hex
    if sampling.seed is None and sampling.temperature > 0:
        sampling = replace(sampling, seed=derived_seed(tenant, request_id))
    return InferenceRequest(
        request_id=request_id,
        session_id=_check_id("session_id", request.session_id),
        tenant=tenant,
        model=request.model,
        sampling=sampling,
        tier=tier_from_pb(request.tier),
        messages=messages,
        prompt=prompt,
        signals=Signals(request.signals.platform, request.signals.regenerate, request.signals.business_tag),
        response_format=request.response_format,
        allow_degraded=request.allow_degraded if request.HasField("allow_degraded") else True,
        schema=schema,
        context_policy=context_policy,
        max_turns=max_turns,
        flush_interval_ms=request.flush_interval_ms,
    )
