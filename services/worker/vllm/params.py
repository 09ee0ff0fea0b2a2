"""An EngineRequest as vLLM sampling parameters, and the checks a request passes first.

Mapping (every field explicit, so a vLLM default or a model's generation_config never
changes what Ballast asked for):
  * temperature 0 is greedy (vLLM treats it so); top_p passes through, and no seed is sent.
  * EOS: `ignore_eos` is on and the engine's EOS ids are sent as `stop_token_ids`, so the
    ids in the ModelDescription (or an override) are exactly the ones that end a stream,
    as on the torch engine.
  * Stop strings go to vLLM so it stops (and frees KV) by itself; vLLM detokenizes only
    when there are stop strings, because the engine computes the streamed text itself.
  * max_tokens passes through (0 never reaches vLLM: the engine answers it directly).
  * DELTA outputs: each output carries only the new tokens.
  * response_format: the JSON Schema goes to vLLM's structured outputs.

Seeded sampling, and its limitation on vLLM. The torch engine draws the token at generated
position p from a generator seeded by (seed, p) alone, so a replica that resumes a stream at
position k samples exactly what the first replica would have. vLLM seeds one generator per
request and advances it with every draw, and it cannot start that generator at position k.
A resumed seeded stream on vLLM therefore continues with *different* (equally valid)
tokens than the uninterrupted stream would have. What it keeps: the request seed is derived
from (seed, k) only (`request_seed`), so the same resume, on any replica, continues with the
same tokens; and an uninterrupted stream is reproducible from its seed. Greedy streams
resume exactly on both engines.

Guided decoding has a similar limit: vLLM's grammar starts at the first generated token and
cannot be advanced over tokens that arrive as part of the prompt. A stream resumed
mid-document therefore continues unguided (the router validates and repairs the result);
`SamplingPlan.guided_dropped` says when that happened.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable

from services.common.errors import InvalidArgument
from services.worker.engine import EngineRequest
from services.worker.sampling import position_seed


@dataclass(frozen=True)
class SamplingPlan:
    kwargs: dict[str, Any]  # SamplingParams keyword arguments, except guidance
    schema: str  # JSON Schema to guide by; "" for none
    guided_dropped: bool  # a schema was asked for but cannot apply to a resumed stream


def validate_request(request: EngineRequest, vocab_size: int, max_context: int) -> None:
    """The torch engine's checks, with the same messages: bad input fails before anything
    reaches vLLM, so vLLM's own (less specific) errors are a last line only."""
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
            f"of {max_context}")
    if not s.temperature >= 0.0:  # also rejects NaN
        raise InvalidArgument("temperature must be >= 0")
    if math.isinf(s.temperature):
        raise InvalidArgument("temperature must be finite")
    if not 0.0 < s.top_p <= 1.0:
        raise InvalidArgument("top_p must be in (0, 1]")
    if any(not stop for stop in s.stop):
        raise InvalidArgument("stop strings must not be empty")
    if request.response_format:
        try:
            schema = json.loads(request.response_format)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"response_format is not valid JSON: {exc.msg}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument("response_format must be a JSON Schema object")


def request_seed(request: EngineRequest) -> int | None:
    """vLLM's per-request seed: from (seed, tokens already generated) only, so any replica
    resuming at the same point continues identically. None for greedy or unseeded."""
    s = request.sampling
    if s.temperature == 0.0 or s.seed is None:
        return None
    return position_seed(s.seed, len(request.generated_ids))


def sampling_plan(request: EngineRequest, eos_token_ids: Iterable[int], delta_kind: Any) -> SamplingPlan:
    s = request.sampling
    greedy = s.temperature == 0.0
    eos = sorted(set(int(t) for t in eos_token_ids))
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": 0.0 if greedy else float(s.temperature),
        "top_p": 1.0 if greedy else float(s.top_p),
        "seed": request_seed(request),
        "max_tokens": int(s.max_tokens),
        "stop": list(s.stop) or None,
        "stop_token_ids": eos or None,
        "ignore_eos": True,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "detokenize": bool(s.stop),
        "output_kind": delta_kind,
    }
    schema = request.response_format
    dropped = bool(schema) and bool(request.generated_ids)
    return SamplingPlan(kwargs, "" if dropped else schema, dropped)
