"""Protobuf at the edge of the degradation flow: tickets, DegradedRequest and BackfilledAnswer.

The router builds a DegradedRequest from its validated domain request; the backfill service
decodes and checks it, builds the replay request and the answer. Both sides use this module so
the wire format has one definition.
"""

from __future__ import annotations

import enum
import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from ballast.v1 import backfill_pb2, common_pb2, inference_pb2
from services.common.sampling_pb import sampling_to_pb
from services.common.tier import Tier
from services.common.tier_pb import TIER_TO_PB


class Level(str, enum.Enum):
    """How far down the ladder a degraded answer came from."""

    LIGHT_MODEL = "light_model"
    RULES = "rules"


TICKET_PREFIX = "bf1-"
_TICKET = re.compile(r"^bf1-[0-9a-f]{32}$")
LEVEL_TO_PB = {Level.LIGHT_MODEL: common_pb2.DEGRADATION_LIGHT_MODEL, Level.RULES: common_pb2.DEGRADATION_RULES}
# The replay's idempotency key: stable per ticket, so the router seeds it the same on every try.
REPLAY_ID_PREFIX = "backfill-"


class InvalidDegradedRequest(ValueError):
    """A record on the degraded topic that no retry can make usable (undecodable or incomplete)."""


def make_ticket(tenant: str, request_id: str) -> str:
    """A ticket derived from the request's idempotency key: a client retrying the same
    request_id gets the same ticket, and the backfill stores one answer for both."""
    digest = hashlib.sha256(f"{tenant}\0{request_id}".encode()).hexdigest()[:32]
    return TICKET_PREFIX + digest


def valid_ticket(ticket: str) -> bool:
    return bool(_TICKET.match(ticket))


def timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def seconds(ts: Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9


def generate_request_pb(request: Any) -> inference_pb2.GenerateRequest:
    """The router's validated InferenceRequest back as a GenerateRequest.

    Sampling is the validated one, seed included, so a replay samples as the original would.
    """
    pb = inference_pb2.GenerateRequest(
        request_id=request.request_id,
        session_id=request.session_id,
        model=request.model,
        sampling=sampling_to_pb(request.sampling),
        tier=TIER_TO_PB.get(request.tier, common_pb2.TIER_AUTO),
        signals=inference_pb2.ClientSignals(
            platform=request.signals.platform,
            regenerate=request.signals.regenerate,
            business_tag=request.signals.business_tag,
        ),
        response_format=request.response_format,
        allow_degraded=request.allow_degraded,
    )
    if request.prompt is not None:
        pb.prompt = request.prompt
    else:
        for message in request.messages:
            pb.conversation.messages.add(role=message.role, content=message.content)
    return pb


def degraded_request_pb(
    request: Any,
    *,
    ticket: str,
    tier: Tier,
    level: Level,
    reason: str,
    degraded_text: str,
    degraded_by: str,
    received_at: float,
    degraded_at: float | None = None,
    origin: str = "",
) -> backfill_pb2.DegradedRequest:
    return backfill_pb2.DegradedRequest(
        ticket=ticket,
        tenant=request.tenant,
        session_id=request.session_id,
        request=generate_request_pb(request),
        tier=TIER_TO_PB.get(tier, common_pb2.TIER_AUTO),
        level=LEVEL_TO_PB[level],
        reason=reason,
        degraded_text=degraded_text,
        degraded_by=degraded_by,
        received_at=timestamp(received_at),
        degraded_at=timestamp(time.time() if degraded_at is None else degraded_at),
        origin=origin,
    )


def kafka_key(session_id: str, ticket: str) -> bytes:
    """Records of one session share a partition (and so stay in order); without a session the
    ticket spreads them."""
    return (session_id or ticket).encode()


def decode_degraded(value: bytes | None) -> backfill_pb2.DegradedRequest:
    """Parses and checks a degraded-topic record; raises InvalidDegradedRequest."""
    if not value:
        raise InvalidDegradedRequest("empty record")
    record = backfill_pb2.DegradedRequest()
    try:
        record.ParseFromString(value)
    except DecodeError as exc:
        raise InvalidDegradedRequest(f"not a DegradedRequest: {exc}") from None
    if not valid_ticket(record.ticket):
        raise InvalidDegradedRequest(f"bad ticket {record.ticket[:80]!r}")
    if not record.request.model:
        raise InvalidDegradedRequest("request.model is empty")
    if record.request.WhichOneof("input") is None:
        raise InvalidDegradedRequest("request has neither conversation nor prompt")
    if not record.HasField("received_at"):
        raise InvalidDegradedRequest("received_at is missing")
    return record


def replay_request(record: backfill_pb2.DegradedRequest, flush_interval_ms: int = 0) -> inference_pb2.GenerateRequest:
    """The request the backfill sends to the router: same input, model and sampling; tier B so
    live traffic goes first; never degraded again (that would only loop); its tokens held
    back `flush_interval_ms` at a time (the answer is stored whole, not streamed to anyone)."""
    replay = inference_pb2.GenerateRequest()
    replay.CopyFrom(record.request)
    replay.request_id = REPLAY_ID_PREFIX + record.ticket
    replay.tier = common_pb2.TIER_B
    replay.allow_degraded = False
    replay.flush_interval_ms = flush_interval_ms
    # No session: the user's conversation went on with the degraded answer, so KV of the replay's
    # answer saved under the session would not be the session's history (and costs a save).
    replay.session_id = ""
    return replay


@dataclass
class ReplayResult:
    """What the full model answered on replay."""

    text: str
    token_ids: list[int]
    finish_reason: int
    prompt_tokens: int
    completion_tokens: int
    model: str
    model_version: str


def backfilled_answer_pb(
    record: backfill_pb2.DegradedRequest, result: ReplayResult, completed_at: float | None = None
) -> backfill_pb2.BackfilledAnswer:
    return backfill_pb2.BackfilledAnswer(
        ticket=record.ticket,
        tenant=record.tenant,
        session_id=record.session_id,
        request_id=record.request.request_id,
        text=result.text,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        usage=common_pb2.Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens),
        model=result.model,
        model_version=result.model_version,
        degraded_level=record.level,
        degraded_text=record.degraded_text,
        received_at=record.received_at,
        completed_at=timestamp(time.time() if completed_at is None else completed_at),
    )
