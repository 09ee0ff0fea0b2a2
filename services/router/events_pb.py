"""The generation runner at the protobuf edge.

Client side: `event_to_pb` turns a plain event (`services.router.events`) into the
`ballast.v1.GenerateEvent` the client receives, once, at the edge of the request path.
Worker side: `worker_request_pb` builds the call a worker gets, and `worker_event_from_pb`
reads the worker's events back as plain values.
"""

from __future__ import annotations

from ballast.v1 import common_pb2, inference_pb2, worker_pb2
from services.common.degraded.codec import LEVEL_TO_PB
from services.common.sampling_pb import FINISH_TO_PB, sampling_to_pb
from services.common.tier import Tier
from services.common.tier_pb import tier_to_pb
from services.router.events import Event, Finished, Resumed, Started, Tokens, WorkerFinished
from services.router.requests import InferenceRequest
from services.router.resilience.resume import ResumePlan
from services.router.structured.repair import Status, StructuredResult

STRUCTURED_STATUS = {
    Status.VALID: common_pb2.STRUCTURED_VALID,
    Status.REPAIRED: common_pb2.STRUCTURED_REPAIRED,
    Status.FAILED: common_pb2.STRUCTURED_FAILED,
}
FINISH_FROM_PB = {value: reason for reason, value in FINISH_TO_PB.items()}


def event_to_pb(event: Event) -> inference_pb2.GenerateEvent:
    if isinstance(event, Tokens):  # by far the most frequent: first
        return inference_pb2.GenerateEvent(
            tokens=common_pb2.Tokens(text=event.text, token_ids=event.token_ids, first_index=event.first_index)
        )
    if isinstance(event, Started):
        return inference_pb2.GenerateEvent(
            started=inference_pb2.Started(
                request_id=event.request_id,
                tier=tier_to_pb(event.tier),
                tier_reason=event.tier_reason,
                model=event.model,
                model_version=event.model_version,
            )
        )
    if isinstance(event, Resumed):
        return inference_pb2.GenerateEvent(
            resumed=inference_pb2.Resumed(next_index=event.next_index, reason=event.reason, resumes=event.resumes)
        )
    if isinstance(event, Finished):
        return inference_pb2.GenerateEvent(finished=_finished_pb(event))
    raise TypeError(f"not a generation event: {event!r}")


def _finished_pb(event: Finished) -> inference_pb2.Finished:
    finished = inference_pb2.Finished(
        reason=common_pb2.FINISH_REASON_UNSPECIFIED if event.reason is None else FINISH_TO_PB[event.reason],
        usage=common_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
        resumes=event.resumes,
        dropped_messages=list(event.dropped_messages),
    )
    if event.structured is not None:
        set_structured(finished, event.structured)
    if event.degradation is not None:
        finished.degradation = LEVEL_TO_PB[event.degradation]
        finished.backfill_ticket = event.backfill_ticket
    return finished


def set_structured(finished: inference_pb2.Finished, result: StructuredResult) -> None:
    """A JSON answer's validation outcome, on the Finished the client receives."""
    finished.structured_status = STRUCTURED_STATUS[result.status]
    finished.structured_repairs.extend(result.messages)
    finished.structured_output = result.text
    finished.structured_errors.extend(result.errors)


def worker_request_pb(
    request: InferenceRequest, plan: ResumePlan, tier: Tier, flush_interval_ms: int
) -> worker_pb2.WorkerGenerateRequest:
    """The worker's part of `request`: the prompt and tokens of `plan`, continued from there."""
    return worker_pb2.WorkerGenerateRequest(
        request_id=request.request_id,
        tenant=request.tenant,
        session_id=request.session_id,
        prompt_ids=plan.prompt_ids,
        generated_ids=plan.generated_ids,
        sampling=sampling_to_pb(plan.sampling),
        response_format=request.response_format,
        tier=tier_to_pb(tier),
        flush_interval_ms=flush_interval_ms,
    )


def worker_event_from_pb(event: worker_pb2.WorkerGenerateEvent) -> Tokens | WorkerFinished | None:
    """A worker's event as a plain value; None for one the router does not relay."""
    if event.HasField("tokens"):
        tokens = event.tokens
        return Tokens(tokens.text, list(tokens.token_ids), tokens.first_index)
    if event.HasField("finished"):
        return WorkerFinished(FINISH_FROM_PB.get(event.finished.reason), event.finished.usage.prompt_tokens)
    return None
