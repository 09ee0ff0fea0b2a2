"""Conversions between protobuf sampling/finish types and the engine's domain types."""

from __future__ import annotations

from ballast.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.common.generation import FinishReason, Sampling

FINISH_TO_PB = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def sampling_from_pb(params: common_pb2.SamplingParams, default_max_tokens: int, max_tokens_limit: int) -> Sampling:
    """Validates client sampling parameters; raises InvalidArgument naming the field."""
    max_tokens = params.max_tokens if params.HasField("max_tokens") else default_max_tokens
    if max_tokens <= 0:
        raise InvalidArgument(f"sampling.max_tokens must be > 0, got {max_tokens}")
    if max_tokens > max_tokens_limit:
        raise InvalidArgument(f"sampling.max_tokens must be <= {max_tokens_limit}, got {max_tokens}")
    temperature = params.temperature if params.HasField("temperature") else 1.0
    if not (0.0 <= temperature <= 10.0) or temperature != temperature:
        raise InvalidArgument(f"sampling.temperature must be in [0, 10], got {temperature}")
    top_p = params.top_p if params.HasField("top_p") else 1.0
    if not (0.0 < top_p <= 1.0):
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {top_p}")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling.stop holds at most {MAX_STOP_STRINGS} strings")
    for stop in params.stop:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidArgument(f"sampling.stop strings must be 1..{MAX_STOP_CHARS} characters")
    return Sampling(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        seed=params.seed if params.HasField("seed") else None,
        stop=tuple(params.stop),
    )


def sampling_to_pb(sampling: Sampling) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop=list(sampling.stop),
    )
    if sampling.seed is not None:
        params.seed = sampling.seed
    return params
