"""Ballast's answer in OpenAI's shapes (pure: no I/O).

`Answer` follows one request's `GenerateEvent`s and renders them as a `chat.completion` /
`text_completion` object, or as stream chunks (`chat.completion.chunk`). Ballast's extras ride
along without breaking SDKs: an extra `ballast` object (degradation level, backfill ticket,
resumes, structured-output status) in the response and in the stream's last chunk, plus the
`x-ballast-degraded` / `x-ballast-backfill-ticket` headers of a non-streamed degraded answer.
With a JSON Schema, a non-streamed answer's content is the validated (possibly repaired) document.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ballast.v1 import common_pb2, inference_pb2
from services.common.tier_pb import TIER_NAMES
from services.router.openai.mapping import Shape

FINISH_REASONS = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_CANCELLED: "stop",
    common_pb2.FINISH_REASON_UNSPECIFIED: "stop",
}
DEGRADATION = {
    common_pb2.DEGRADATION_NONE: "none",
    common_pb2.DEGRADATION_LIGHT_MODEL: "light_model",
    common_pb2.DEGRADATION_RULES: "rules",
}
STRUCTURED = {
    common_pb2.STRUCTURED_NONE: None,
    common_pb2.STRUCTURED_VALID: "valid",
    common_pb2.STRUCTURED_REPAIRED: "repaired",
    common_pb2.STRUCTURED_FAILED: "failed",
}
DEGRADED_HEADER = "x-ballast-degraded"
TICKET_HEADER = "x-ballast-backfill-ticket"


def ballast_extras(finished: inference_pb2.Finished, started: inference_pb2.Started | None) -> dict:
    extras = {
        "request_id": started.request_id if started is not None else "",
        "model_version": started.model_version if started is not None else "",
        # The tier the request ran at, after its tenant's grant (tier_reason capped_by_grant when lowered).
        "tier": TIER_NAMES.get(started.tier, "") if started is not None else "",
        "tier_reason": started.tier_reason if started is not None else "",
        "degradation": DEGRADATION.get(finished.degradation, "none"),
        "backfill_ticket": finished.backfill_ticket,
        "resumes": finished.resumes,
    }
    status = STRUCTURED.get(finished.structured_status)
    if status is not None:
        extras["structured"] = {
            "status": status,
            "repairs": list(finished.structured_repairs),
            "errors": list(finished.structured_errors),
        }
    return extras


def degraded_headers(finished: inference_pb2.Finished) -> dict[str, str]:
    if finished.degradation == common_pb2.DEGRADATION_NONE:
        return {}
    headers = {DEGRADED_HEADER: DEGRADATION[finished.degradation]}
    if finished.backfill_ticket:
        headers[TICKET_HEADER] = finished.backfill_ticket
    return headers


def _usage(finished: inference_pb2.Finished) -> dict:
    prompt, completion = finished.usage.prompt_tokens, finished.usage.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class Answer:
    """One request's answer as it arrives; `feed` each event, then render."""

    shape: Shape
    created: int = field(default_factory=lambda: int(time.time()))
    started: inference_pb2.Started | None = None
    finished: inference_pb2.Finished | None = None
    parts: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        request_id = self.started.request_id if self.started is not None else ""
        return f"{'chatcmpl' if self.shape.chat else 'cmpl'}-{request_id}"

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.shape.chat else "text_completion"

    def feed(self, event: inference_pb2.GenerateEvent) -> str | None:
        """Takes one event; returns the text it adds (None for events without text)."""
        kind = event.WhichOneof("event")
        if kind == "tokens":
            self.parts.append(event.tokens.text)
            return event.tokens.text
        if kind == "started":
            self.started = event.started
        elif kind == "finished":
            self.finished = event.finished
        return None

    # -- non-streamed ---------------------------------------------------------------------

    def text(self) -> str:
        finished = self.finished
        if (
            finished is not None
            and finished.structured_status in (common_pb2.STRUCTURED_VALID, common_pb2.STRUCTURED_REPAIRED)
            and finished.structured_output
        ):
            return finished.structured_output
        return "".join(self.parts)

    def response(self) -> dict:
        finished = self.finished or inference_pb2.Finished()
        reason = FINISH_REASONS.get(finished.reason, "stop")
        if self.shape.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text()},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {"index": 0, "text": self.text(), "logprobs": None, "finish_reason": reason}
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.shape.model,
            "choices": [choice],
            "usage": _usage(finished),
            "ballast": ballast_extras(finished, self.started),
        }

    # -- streamed -------------------------------------------------------------------------

    def _chunk(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.shape.chat else "text_completion",
            "created": self.created,
            "model": self.shape.model,
            "choices": choices,
        }

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role (as OpenAI's do); completions do not."""
        if not self.shape.chat:
            return None
        return self._chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def text_chunk(self, text: str) -> dict:
        if self.shape.chat:
            return self._chunk([{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])
        return self._chunk([{"index": 0, "text": text, "logprobs": None, "finish_reason": None}])

    def final_chunks(self) -> list[dict]:
        """The chunk with the finish reason and the `ballast` extras, then the usage chunk if asked."""
        finished = self.finished or inference_pb2.Finished()
        reason = FINISH_REASONS.get(finished.reason, "stop")
        if self.shape.chat:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
        last = self._chunk([choice])
        last["ballast"] = ballast_extras(finished, self.started)
        chunks = [last]
        if self.shape.include_usage:
            usage = self._chunk([])
            usage["usage"] = _usage(finished)
            chunks.append(usage)
        return chunks
