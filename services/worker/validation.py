"""The checks every engine runs on a request before it starts: one set, so the torch engine
and vLLM refuse the same input with the same message."""

from __future__ import annotations

import math

from services.common.errors import InvalidArgument
from services.common.schema_limits import SchemaLimits, parse_schema
from services.worker.engine import EngineRequest


SCHEMA_LIMITS = SchemaLimits()


def validate_request(
    request: EngineRequest, vocab_size: int, max_context: int, schema_limits: SchemaLimits | None = None
) -> None:
    """Raises InvalidArgument, naming the field, for a request no engine can serve. Every
    engine runs it before anything starts (on vLLM: before vLLM's own, less specific, checks),
    so bad input gets the same status and message whatever the engine."""
    s = request.sampling
    if not request.prompt_ids:
        raise InvalidArgument("prompt is empty")
    if vocab_size:
        bad = [t for t in (*request.prompt_ids, *request.generated_ids) if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if s.max_tokens < 0:
        raise InvalidArgument("max_tokens must be >= 0")
    total = len(request.prompt_ids) + len(request.generated_ids) + s.max_tokens
    if total > max_context:
        raise InvalidArgument(
            f"prompt ({len(request.prompt_ids)}) + generated ({len(request.generated_ids)}) "
            f"+ max_tokens ({s.max_tokens}) = {total} tokens exceeds the model's context "
            f"of {max_context}"
        )
    if not s.temperature >= 0.0:  # also rejects NaN
        raise InvalidArgument("temperature must be >= 0")
    if math.isinf(s.temperature):
        raise InvalidArgument("temperature must be finite")
    if not 0.0 < s.top_p <= 1.0:
        raise InvalidArgument("top_p must be in (0, 1]")
    if any(not stop for stop in s.stop):
        raise InvalidArgument("stop strings must not be empty")
    if request.response_format:
        # Bounded before any grammar compiler (llguidance, vLLM's) sees it: a request may come
        # from a router of another version that did not check.
        parse_schema(request.response_format, schema_limits or SCHEMA_LIMITS)
