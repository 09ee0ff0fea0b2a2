"""The events of one request's stream, as plain Python values.

The generation runner yields these, the degradation ladder relays and marks them, and the
request path's edge (`InferenceServicer.generate`, through `events_pb`) turns each into a
`ballast.v1.GenerateEvent` message once. One event per message: `Started` once a worker (and
with it the model version) is chosen, `Tokens` as they arrive, `Resumed` when the stream
continues after a pause or on another worker, `Finished` at the end. `WorkerFinished` is
what a worker says at its end, before the router completes it into `Finished`.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.degraded.codec import Level
from services.common.generation import FinishReason
from services.common.tier import Tier
from services.router.structured.repair import StructuredResult


@dataclass(frozen=True)
class Started:
    request_id: str
    tier: Tier
    tier_reason: str
    model: str
    model_version: str


@dataclass(frozen=True)
class Tokens:
    text: str
    token_ids: list[int]
    # Position of token_ids[0] among the generated tokens of the request.
    first_index: int


@dataclass(frozen=True)
class Resumed:
    next_index: int
    reason: str
    resumes: int


@dataclass(frozen=True)
class Finished:
    # None: the worker did not say why.
    reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    resumes: int
    dropped_messages: tuple[int, ...] = ()
    # Set for a request with a JSON Schema: the answer validated (and repaired).
    structured: StructuredResult | None = None
    # Set for a degraded answer: the rung it came from, and the ticket of the better answer the
    # backfill will deliver ("" when the hand-off was refused).
    degradation: Level | None = None
    backfill_ticket: str = ""


@dataclass(frozen=True)
class WorkerFinished:
    reason: FinishReason | None
    prompt_tokens: int


Event = Started | Tokens | Resumed | Finished
