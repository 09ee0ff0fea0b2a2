"""The runner's and the ladder's plain events become, at the edge, the very bytes a hand-built
`GenerateEvent` has; the worker's events read back as plain values."""

import pytest

from ballast.v1 import common_pb2, inference_pb2, worker_pb2
from services.common.degraded.codec import Level
from services.common.generation import FinishReason, Sampling
from services.router.events import Finished, Resumed, Started, Tokens, WorkerFinished
from services.router.events_pb import event_to_pb, worker_event_from_pb, worker_request_pb
from services.router.requests import InferenceRequest
from services.router.resilience.resume import plan_resume
from services.router.structured.repair import Repair, RepairKind, Status, StructuredResult


def same_bytes(event, expected: inference_pb2.GenerateEvent) -> None:
    assert event_to_pb(event).SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)


def test_started_tokens_and_resumed_match_their_messages():
    same_bytes(
        Started("r1", "A", "explicit", "tiny", "v7"),
        inference_pb2.GenerateEvent(
            started=inference_pb2.Started(
                request_id="r1", tier=common_pb2.TIER_A, tier_reason="explicit", model="tiny", model_version="v7"
            )
        ),
    )
    same_bytes(
        Tokens("he", [5, 6], 3),
        inference_pb2.GenerateEvent(tokens=common_pb2.Tokens(text="he", token_ids=[5, 6], first_index=3)),
    )
    same_bytes(Tokens("", [], 0), inference_pb2.GenerateEvent(tokens=common_pb2.Tokens()))
    same_bytes(
        Resumed(4, "worker_lost", 2),
        inference_pb2.GenerateEvent(resumed=inference_pb2.Resumed(next_index=4, reason="worker_lost", resumes=2)),
    )


def test_finished_matches_its_message_with_and_without_a_schema():
    plain = Finished(FinishReason.STOP, 10, 3, resumes=1, dropped_messages=(0, 2))
    same_bytes(
        plain,
        inference_pb2.GenerateEvent(
            finished=inference_pb2.Finished(
                reason=common_pb2.FINISH_REASON_STOP,
                usage=common_pb2.Usage(prompt_tokens=10, completion_tokens=3),
                resumes=1,
                dropped_messages=[0, 2],
            )
        ),
    )
    unspecified = Finished(None, 1, 0, resumes=0)
    same_bytes(
        unspecified,
        inference_pb2.GenerateEvent(finished=inference_pb2.Finished(usage=common_pb2.Usage(prompt_tokens=1))),
    )
    result = StructuredResult(
        Status.REPAIRED, {"a": 1}, '{"a": 1}', repairs=(Repair(RepairKind.SYNTAX, "closed a quote"),), errors=("late",)
    )
    structured = Finished(FinishReason.LENGTH, 5, 8, resumes=0, structured=result)
    expected = inference_pb2.Finished(
        reason=common_pb2.FINISH_REASON_LENGTH, usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=8)
    )
    expected.structured_status = common_pb2.STRUCTURED_REPAIRED
    expected.structured_repairs.extend(["closed a quote"])
    expected.structured_output = '{"a": 1}'
    expected.structured_errors.extend(["late"])
    same_bytes(structured, inference_pb2.GenerateEvent(finished=expected))


def test_anything_else_is_not_an_event():
    with pytest.raises(TypeError):
        event_to_pb(WorkerFinished(FinishReason.STOP, 1))


def test_a_degraded_finished_carries_its_rung_and_ticket():
    degraded = Finished(FinishReason.STOP, 0, 4, resumes=0, degradation=Level.RULES, backfill_ticket="t-1")
    same_bytes(
        degraded,
        inference_pb2.GenerateEvent(
            finished=inference_pb2.Finished(
                reason=common_pb2.FINISH_REASON_STOP,
                usage=common_pb2.Usage(completion_tokens=4),
                degradation=common_pb2.DEGRADATION_RULES,
                backfill_ticket="t-1",
            )
        ),
    )
    light = Finished(FinishReason.LENGTH, 3, 2, resumes=0, degradation=Level.LIGHT_MODEL)
    assert event_to_pb(light).finished.degradation == common_pb2.DEGRADATION_LIGHT_MODEL


def test_worker_events_read_back_as_plain_values():
    tokens = worker_pb2.WorkerGenerateEvent(tokens=common_pb2.Tokens(text="x", token_ids=[9], first_index=2))
    assert worker_event_from_pb(tokens) == Tokens("x", [9], 2)
    finished = worker_pb2.WorkerGenerateEvent(
        finished=worker_pb2.WorkerFinished(
            reason=common_pb2.FINISH_REASON_STOP, usage=common_pb2.Usage(prompt_tokens=4)
        )
    )
    assert worker_event_from_pb(finished) == WorkerFinished(FinishReason.STOP, 4)
    assert worker_event_from_pb(worker_pb2.WorkerGenerateEvent()) is None


def test_worker_request_continues_from_the_plan():
    request = InferenceRequest(
        request_id="r1", tenant="t", session_id="s", model="tiny", sampling=Sampling(max_tokens=5, seed=3), tier="B"
    )
    plan = plan_resume([1, 2], request.sampling, [7])
    sent = worker_request_pb(request, plan, "B", 40)
    assert list(sent.prompt_ids) == [1, 2] and list(sent.generated_ids) == [7]
    assert sent.sampling.max_tokens == 4 and sent.sampling.seed == 3
    assert (sent.request_id, sent.tenant, sent.session_id) == ("r1", "t", "s")
    assert sent.tier == common_pb2.TIER_B and sent.flush_interval_ms == 40
