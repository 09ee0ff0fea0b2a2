"""A small asyncio client of the public Inference API (used by `ballast chat`, tests, benches)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from ballast.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.common.tls import credentials
from services.common.tls.settings import TLSConfig
from services.common.tier_pb import TIER_TO_PB


@dataclass
class StreamResult:
    """Everything one Generate stream delivered."""

    started: inference_pb2.Started | None = None
    token_ids: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    text: str = ""
    finished: inference_pb2.Finished | None = None
    events: int = 0


def chat_request(
    text: str,
    model: str = "tiny",
    max_tokens: int = 32,
    temperature: float = 0.0,
    seed: int | None = None,
    tier: str = "AUTO",
    session_id: str = "",
    raw_prompt: bool = False,
    request_id: str = "",
    allow_degraded: bool | None = None,
) -> inference_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    request = inference_pb2.GenerateRequest(
        request_id=request_id, session_id=session_id, model=model, sampling=sampling, tier=TIER_TO_PB[tier]
    )
    if allow_degraded is not None:
        request.allow_degraded = allow_degraded
    if raw_prompt:
        request.prompt = text
    else:
        request.conversation.messages.add(role="user", content=text)
    return request


def api_key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("x-api-key", api_key),) if api_key else ()


async def collect(
    stub: inference_pb2_grpc.InferenceStub,
    request: inference_pb2.GenerateRequest,
    api_key: str | None,
    timeout: float = 60.0,
    on_tokens=None,
) -> StreamResult:
    """Runs one stream to its end; `on_tokens(Tokens)` sees each tokens event as it arrives."""
    result = StreamResult()
    call = stub.Generate(request, metadata=api_key_metadata(api_key), timeout=timeout)
    async for event in call:
        result.events += 1
        kind = event.WhichOneof("event")
        if kind == "started":
            result.started = event.started
        elif kind == "tokens":
            tokens = event.tokens
            result.indices.extend(range(tokens.first_index, tokens.first_index + len(tokens.token_ids)))
            result.token_ids.extend(tokens.token_ids)
            result.text += tokens.text
            if on_tokens is not None:
                on_tokens(tokens)
        elif kind == "finished":
            result.finished = event.finished
    return result


def open_channel(address: str, tls: TLSConfig | None = None) -> grpc.aio.Channel:
    """A channel to the router's public port; `tls`: the caller's TLS settings (its own
    certificate is presented when it has one), or None for plaintext."""
    return credentials.open_channel(address, tls.towards_public_port() if tls is not None else None)
