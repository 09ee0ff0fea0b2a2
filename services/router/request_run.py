"""One request's run on a pool's workers, as the generation runner keeps it: what the request
asks, how it is scheduled, and what it has delivered so far across attempts and resumes."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.tier import Tier
from services.router.requests import InferenceRequest
from services.router.resilience.retry_budget import RequestAttempts


@dataclass
class StreamState:
    """What one request has delivered so far, across attempts."""

    sent_ids: list[int] = field(default_factory=list)
    resumes: int = 0
    model_version: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    # Relayed text, kept only for a request with a JSON Schema (to validate and repair it)
    # or a mirrored one (to compare it with the candidate's answer).
    text_parts: list[str] | None = None
    keep_text: bool = False
    dropped: tuple[int, ...] = ()


@dataclass
class RequestRun:
    """One request's run on a pool's workers: what it asks, how it is scheduled, and what
    it has delivered so far. The caller builds one per run (a degraded retry on another pool
    is a run of its own); the runner keeps the attempt state in it."""

    request: InferenceRequest
    tier: Tier
    # Why this tier: the auto-tagging rule that decided it, or "explicit".
    reason: str
    # The scheduling weight within the tier.
    weight: float
    # time.monotonic() by which the client wants its answer.
    deadline: float
    # time.perf_counter() when the router received the request.
    started: float
    state: StreamState = field(default_factory=StreamState)
    # Set by the runner when the run starts: the retry budget's account of this request.
    attempts: RequestAttempts | None = None

    def ttft_ms(self) -> float | None:
        first = self.state.first_token_at
        return None if first is None else (first - self.started) * 1000
