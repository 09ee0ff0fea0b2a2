"""The engine protocol: what a worker needs from a model runtime (torch on CPU, vLLM on GPU).

The worker's gRPC layer depends only on this module, so engines can be swapped by config
and tested by one conformance suite. Everything here is plain Python, no protobuf.

Beside `Engine`, what only some engines can do is declared here too, one small protocol per
capability: `KvAttachable` (session KV metrics and persistence), `ChunkedPrefill` (prefill in
chunks of a known size), `Wakeable` (a sleeping warm standby woken on promotion) and
`Stepping` (counts its steps, so the worker can say it is busy, not wedged). An engine
class names the ones it implements among its bases, and the worker asks with `isinstance`,
never by probing for attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Protocol, runtime_checkable

from services.common.generation import FinishReason, Sampling

if TYPE_CHECKING:
    from services.worker.kv.metrics import KVMetrics
    from services.worker.kv.session import SessionKV

__all__ = [
    "CAPABILITIES",
    "ChunkedPrefill",
    "Engine",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "KvAttachable",
    "ModelDescription",
    "Sampling",
    "Stepping",
    "TokenDelta",
    "Wakeable",
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


# --- optional capabilities -----------------------------------------------------------------
@runtime_checkable
class KvAttachable(Protocol):
    """Reports KV reuse through the worker's KV metrics and, given a session KV client,
    restores and saves sessions' KV through the cache service."""

    def attach_kv(self, metrics: KVMetrics, session_kv: SessionKV | None = None) -> bool:
        """Call after start(). False when this engine cannot store this model's KV."""
        ...


@runtime_checkable
class ChunkedPrefill(Protocol):
    """Computes a prompt's prefill in chunks of `prefill_chunk` tokens (the KV cost model
    weighs a restore against that many chunks of compute)."""

    @property
    def prefill_chunk(self) -> int: ...


@runtime_checkable
class Wakeable(Protocol):
    """May sleep as a warm standby (weights off the accelerator); `wake_up` brings it back
    before it takes work, and does nothing when it is awake."""

    async def wake_up(self) -> None: ...


@runtime_checkable
class Stepping(Protocol):
    """Counts the steps it has computed: each prefill chunk and each decode step (of a batch
    or of one sequence), never a step that computed nothing. The count moves while a long or
    queued prefill produces no token and stops when the engine hangs, so the worker can tell a
    router waiting for a first token that the engine is busy, not wedged
    (services.worker.relay_progress). It is the engine's, not a request's: a request stuck on
    its own while the engine computes for others (a grammar that never compiles) does not stop
    it; such a request wedges no worker, and its waits end by the router's timeouts."""

    @property
    def steps(self) -> int: ...


# Every optional capability, for the check that each engine class declares what it implements.
CAPABILITIES: tuple[type, ...] = (KvAttachable, ChunkedPrefill, Wakeable, Stepping)
