"""`GET /v1/ballast/backfill/{ticket}`: a backfilled answer (`ballast.v1.BackfilledAnswer`) as JSON."""

from __future__ import annotations

from ballast.v1 import backfill_answers_pb2
from services.router.openai.responses import DEGRADATION, FINISH_REASONS


def _timestamp(value) -> str | None:
    if not value.seconds and not value.nanos:
        return None
    return value.ToJsonString()


def answer_json(answer: backfill_answers_pb2.BackfilledAnswer) -> dict:
    prompt, completion = answer.usage.prompt_tokens, answer.usage.completion_tokens
    return {
        "object": "ballast.backfilled_answer",
        "ticket": answer.ticket,
        "session_id": answer.session_id,
        "request_id": answer.request_id,
        "model": answer.model,
        "model_version": answer.model_version,
        "text": answer.text,
        "finish_reason": FINISH_REASONS.get(answer.finish_reason, "stop"),
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        "degraded_level": DEGRADATION.get(answer.degraded_level, "none"),
        "degraded_text": answer.degraded_text,
        "received_at": _timestamp(answer.received_at),
        "completed_at": _timestamp(answer.completed_at),
    }
