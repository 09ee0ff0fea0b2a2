"""The per-request arguments Ballast's logits processors read inside vLLM
(`SamplingParams.extra_args`), built by the worker and parsed by `processors`. Pure: no vLLM."""

from __future__ import annotations

from typing import Any, Sequence

SAMPLER_KEY = "ballast_sampler"
GUIDE_KEY = "ballast_guide"

# vLLM loads these by name in its engine process (engine argument `logits_processors`).
PROCESSOR_NAMES = (
    # The guide masks first, so the sampler draws among allowed tokens only.
    "services.worker.vllm.processors:ResumedGuide",
    "services.worker.vllm.processors:PositionSampler",
)


def sampler_args(seed: int, generated_before: int, temperature: float, top_p: float) -> dict[str, Any]:
    """extra_args for a seeded sampled request whose first new token is generated position
    `generated_before` (the ids already sent by an earlier replica)."""
    return {
        SAMPLER_KEY: {
            "seed": int(seed),
            "offset": int(generated_before),
            "temperature": float(temperature),
            "top_p": float(top_p),
        }
    }


def guide_args(schema: str, generated_ids: Sequence[int]) -> dict[str, Any]:
    """extra_args for a guided request resumed after `generated_ids`."""
    return {GUIDE_KEY: {"schema": schema, "generated": [int(t) for t in generated_ids]}}


def request_args(params: Any, key: str) -> dict[str, Any] | None:
    """The arguments under `key` in a SamplingParams' extra_args; None when absent."""
    extra = getattr(params, "extra_args", None) or {}
    value = extra.get(key)
    return value if isinstance(value, dict) else None
