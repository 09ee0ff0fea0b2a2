"""The request the backfill replays: the degraded request's input, at tier B, never degraded
again, without the session (it runs under the backfill's own tenant)."""

from __future__ import annotations

from ballast.v1 import backfill_pb2, common_pb2, inference_pb2
from services.common.degraded.codec import REPLAY_ID_PREFIX, replay_request


def degraded_record() -> backfill_pb2.DegradedRequest:
    request = inference_pb2.GenerateRequest(
        request_id="r-1",
        model="tiny",
        session_id="s-9",
        tier=common_pb2.TIER_S,
        allow_degraded=True,
        sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0.0, seed=7),
    )
    request.prompt = "Where is my order 12345?"
    return backfill_pb2.DegradedRequest(ticket="bf1-abc", tenant="acme", session_id="s-9", request=request)


def test_replay_keeps_the_input_and_sampling():
    record = degraded_record()
    replay = replay_request(record)
    assert replay.model == "tiny"
    assert replay.prompt == "Where is my order 12345?"
    assert replay.sampling == record.request.sampling


def test_replay_runs_at_tier_b_without_degradation_or_session():
    replay = replay_request(degraded_record())
    assert replay.tier == common_pb2.TIER_B
    assert replay.allow_degraded is False
    assert replay.session_id == ""
    assert replay.request_id == REPLAY_ID_PREFIX + "bf1-abc"


def test_the_degraded_record_is_left_as_it_was():
    record = degraded_record()
    replay_request(record)
    assert record.request.session_id == "s-9" and record.request.tier == common_pb2.TIER_S


def test_replay_tokens_are_held_back_as_asked():
    assert replay_request(degraded_record()).flush_interval_ms == 0
    assert replay_request(degraded_record(), flush_interval_ms=1000).flush_interval_ms == 1000
