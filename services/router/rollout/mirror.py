"""Traffic mirroring: a copy of a request runs on the candidate version; its answer is compared
with the primary's and thrown away.

The copy runs in a background task, so it never reaches the client and never delays the
primary stream. Mirrors are bounded: at most `max_concurrent` at once per router, and a copy
is dropped (not queued) when that many run or the candidate has no idle worker. The
comparison (time to first token on both sides, the candidate's error, token agreement and
an optional business score) goes to the metrics and to the candidate's SLO gate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from services.common.errors import BallastError
from services.common.membership import WorkerRecord
from services.common.tier import Tier
from services.router.context.window import fit_request_async
from services.router.events import Tokens, WorkerFinished
from services.router.events_pb import worker_request_pb
from services.router.model_registry import ModelRegistry
from services.router.requests import InferenceRequest
from services.router.resilience.breaker import Outcome, outcome_of
from services.router.resilience.resume import plan_resume
from services.router.worker_call import WorkerCall
from services.router.worker_clients import WorkerChannels

log = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENT = 4
DEFAULT_TIMEOUT_S = 30.0

# (request, primary answer text, candidate answer text) -> score, or None for "no opinion".
BusinessScore = Callable[[InferenceRequest, str, str], float | None]


@dataclass
class Answer:
    """One side's answer to a mirrored request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    ttft_ms: float | None = None
    # Why the side failed; None when it answered.
    error: str | None = None
    # Whether the failure is the worker's fault (client errors and cancellations are not).
    fault: bool = False


@dataclass(frozen=True)
class Comparison:
    model: str
    candidate: str
    primary: Answer
    mirror: Answer
    agreement: float | None
    business_score: float | None


def token_agreement(primary: list[int], mirror: list[int]) -> float:
    """Share of positions (over the longer answer) where both answers have the same token."""
    longest = max(len(primary), len(mirror))
    if longest == 0:
        return 1.0
    return sum(1 for a, b in zip(primary, mirror) if a == b) / longest


class MirrorHandle:
    """Given to the primary stream: it reports its own answer when done, without waiting."""

    def __init__(self) -> None:
        self._primary: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()

    def primary_done(self, answer: Answer) -> None:
        if not self._primary.done():
            self._primary.set_result(answer)

    async def primary(self, timeout_s: float) -> Answer | None:
        try:
            return await asyncio.wait_for(asyncio.shield(self._primary), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            return None


class MirrorRunner:
    def __init__(
        self,
        clients: WorkerChannels,
        models: ModelRegistry,
        on_comparison: Callable[[Comparison], None],
        on_outcome: Callable[[str, str], None],
        business_score: BusinessScore | None = None,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self._clients = clients
        self._models = models
        self._on_comparison = on_comparison
        # (model, outcome) for every copy: compared, candidate_error, dropped_*, primary_failed.
        self._on_outcome = on_outcome
        self.business_score = business_score
        self.max_concurrent = max_concurrent
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task] = set()

    @property
    def tasks(self) -> set[asyncio.Task]:
        return set(self._tasks)

    def offer(
        self, request: InferenceRequest, candidate: str, worker: WorkerRecord | None, deadline: float
    ) -> MirrorHandle | None:
        """Starts a copy on `worker` (an idle candidate worker), or drops it; never blocks."""
        if worker is None:
            self._on_outcome(request.model, "dropped_no_worker")
            return None
        if len(self._tasks) >= self.max_concurrent:
            self._on_outcome(request.model, "dropped_busy")
            return None
        handle = MirrorHandle()
        task = asyncio.create_task(
            self._mirror(request, candidate, worker, deadline, handle), name=f"mirror-{request.request_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle

    async def _mirror(
        self, request: InferenceRequest, candidate: str, worker: WorkerRecord, deadline: float, handle: MirrorHandle
    ) -> None:
        try:
            budget = min(self.timeout_s, deadline - time.monotonic())
            mirror = await self._generate(request, worker, time.monotonic() + budget)
            primary = await handle.primary(deadline - time.monotonic())
            if primary is None or primary.error is not None:
                # Nothing to compare against; the candidate's own fault still counts.
                self._on_outcome(request.model, "primary_failed")
                if mirror.fault:
                    self._on_comparison(Comparison(request.model, candidate, primary or Answer(), mirror, None, None))
                return
            self._on_outcome(request.model, "compared" if mirror.error is None else "candidate_error")
            agreement = token_agreement(primary.token_ids, mirror.token_ids) if mirror.error is None else None
            score = None
            if self.business_score is not None and mirror.error is None:
                try:
                    score = self.business_score(request, primary.text, mirror.text)
                except Exception:  # a broken hook must not break mirroring
                    log.exception("business score hook failed on request %s", request.request_id)
            self._on_comparison(Comparison(request.model, candidate, primary, mirror, agreement, score))
        except Exception:
            log.exception("mirror of request %s failed", request.request_id)

    async def _generate(self, request: InferenceRequest, worker: WorkerRecord, deadline: float) -> Answer:
        answer = Answer()
        started = time.perf_counter()
        try:
            tokenizer = await self._models.tokenizer_for(worker, deadline - time.monotonic())
            _, fit = await fit_request_async(
                request, tokenizer, policy=request.context_policy, max_turns=request.max_turns
            )
            plan = plan_resume(list(fit.prompt_ids), request.sampling, [])
            # Its own id and no session: the copy must not touch the session's saved KV.
            copy = dataclasses.replace(request, request_id=f"{request.request_id}:mirror", session_id="")
            # Shadow traffic: the candidate's live requests go first.
            call_request = worker_request_pb(copy, plan, Tier.B, 0)
            with WorkerCall(self._clients, worker.address, call_request, deadline, relay=worker.relay) as call:
                async for event in call.events():
                    if isinstance(event, Tokens):
                        if answer.ttft_ms is None:
                            answer.ttft_ms = (time.perf_counter() - started) * 1000
                        answer.token_ids.extend(event.token_ids)
                        answer.text += event.text
                    elif isinstance(event, WorkerFinished):
                        return answer
            answer.error = "stream ended without finishing"
            answer.fault = True
        except (grpc.aio.AioRpcError, BallastError) as error:
            answer.error = error.code().name if isinstance(error, grpc.aio.AioRpcError) else error.code.name
            answer.fault = outcome_of(error) is Outcome.FAULT
        return answer
