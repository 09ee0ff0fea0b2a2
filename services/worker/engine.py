"""The engine protocol: what a worker needs from a model runtime (torch on CPU, vLLM on GPU).

The worker's gRPC layer depends only on this module, so engines can be swapped by config
and tested by one conformance suite. Everything here is plain Python, no protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from services.common.generation import FinishReason, Sampling

__all__ = [
    "Engine",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "ModelDescription",
    "Sampling",
    "TokenDelta",
]


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    # Tokens already generated (by this or another replica); generation continues after them.
    generated_ids: tuple[int, ...]
    sampling: Sampling
    tenant: str = ""
    session_id: str = ""
    # A JSON Schema (as JSON text) the output must conform to; "" for free text.
    response_format: str = ""
    # Scheduling priority, lower first: tier S 0, A 1, B 2 (services.worker.servicer).
    priority: int = 1

    @property
    def scheduling_priority(self) -> int:
        """The priority an engine schedules this request at: its tier's, one tier ahead for
        a resumed stream (it carries tokens generated elsewhere: it broke mid-answer, and
        its user is already waiting on a pause)."""
        return self.priority - 1 if self.generated_ids else self.priority


@dataclass
class TokenDelta:
    """New tokens of one request. `finish_reason` is set on the last delta only."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    # On the first delta: context tokens this request computed by prefill (the rest came
    # from a reused or restored KV cache). None: the engine does not say.
    prefill_tokens: int | None = None


@dataclass(frozen=True)
class ModelDescription:
    """What a worker publishes about its model."""

    name: str
    version: str
    max_context: int
    tokenizer_json: bytes
    chat_template: str
    bos_token: str
    eos_token: str
    eos_token_ids: tuple[int, ...]


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_tokens: int = 0
    kv_capacity_tokens: int = 1
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def kv_used(self) -> float:
        return min(1.0, self.kv_tokens / max(1, self.kv_capacity_tokens))


class Engine(Protocol):
    """A model runtime. `generate` is cancellation-safe: closing or cancelling the
    iterator aborts the request and frees its KV at once."""

    @property
    def model(self) -> ModelDescription: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]: ...

    def stats(self) -> EngineStats: ...

    def tokenize(self, text: str) -> list[int]: ...
