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

Seeded sampling is exact across replicas. vLLM seeds one generator per request and advances it
with every draw, so its own sampler cannot resume a stream at generated position k. A seeded
request is therefore sent to vLLM as greedy, with `extra_args` naming the seed, the temperature,
top_p and k (`request_args.sampler_args`): Ballast's logits processor inside vLLM picks the token
at position p exactly as the torch engine does (a generator seeded by (seed, p) alone) and
leaves it the only choice. A resumed stream continues with the tokens the uninterrupted one
would have drawn; an uninterrupted one is reproducible from its seed.

Guided decoding: a fresh stream uses vLLM's structured outputs. vLLM's grammar starts at the
first generated token and cannot be advanced over tokens that arrive as part of the prompt, so
a stream resumed mid-document instead carries the schema and the ids already generated
(`request_args.guide_args`) to Ballast's processor, which masks with the same grammar from where
the first replica stopped (`SamplingPlan.resumed_guide`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from services.worker.engine import EngineRequest
from services.worker.sampling import fresh_seed
from services.worker.vllm.request_args import guide_args, sampler_args


@dataclass(frozen=True)
class SamplingPlan:
    kwargs: dict[str, Any]  # SamplingParams keyword arguments, except vLLM's own guidance
    schema: str  # JSON Schema for vLLM's structured outputs (a fresh stream); "" for none
    resumed_guide: bool  # the schema goes to Ballast's processor instead (a resumed stream)


def sampling_plan(request: EngineRequest, eos_token_ids: Iterable[int], delta_kind: Any) -> SamplingPlan:
    s = request.sampling
    sampled = s.temperature > 0.0
    if sampled and s.seed is None:
        # The router gives every request a seed; one without is sampled from fresh randomness.
        seed = fresh_seed()
    else:
        seed = s.seed
    eos = sorted(set(int(t) for t in eos_token_ids))
    extra: dict[str, Any] = {}
    if sampled:
        extra.update(sampler_args(seed, len(request.generated_ids), s.temperature, s.top_p))
    schema = request.response_format
    resumed_guide = bool(schema) and bool(request.generated_ids)
    if resumed_guide:
        extra.update(guide_args(schema, request.generated_ids))
    kwargs: dict[str, Any] = {
        "n": 1,
        # vLLM decodes greedily: for sampled requests Ballast's processor has already made
        # the position-seeded choice the only finite logit.
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "max_tokens": int(s.max_tokens),
        "stop": list(s.stop) or None,
        "stop_token_ids": eos or None,
        "ignore_eos": True,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "detokenize": bool(s.stop),
        "output_kind": delta_kind,
        "extra_args": extra or None,
    }
    return SamplingPlan(kwargs, "" if resumed_guide else schema, resumed_guide)
