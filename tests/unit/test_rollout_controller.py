"""The controller's bookkeeping without etcd: documents applied or refused, samples counted
only for a running candidate, mirrors bounded and dropped rather than queued."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.generation import Sampling
from services.common.membership import WorkerRecord
from services.router.requests import InferenceRequest
from services.router.rollout.controller import RolloutController
from services.router.rollout.gate import Verdict
from services.router.rollout.mirror import token_agreement
from services.router.rollout.split import Role
from services.router.rollout.state import Phase, Rollout
from services.router.worker_clients import WorkerClients

ROLLOUT = Rollout("tiny", "v1", "v2", weight=100.0)


class BlockedRegistry:
    """Stands in for the model registry: a mirror waits on it until cancelled."""

    async def tokenizer_for(self, worker, timeout_s):
        await asyncio.Event().wait()


def controller(models=None) -> RolloutController:
    return RolloutController(None, WorkerClients(), models)


def request(request_id: str = "r1", model: str = "tiny") -> InferenceRequest:
    return InferenceRequest(request_id, "s1", "acme", model, Sampling(max_tokens=4), "A", prompt="hi")


def test_a_bad_document_keeps_the_previous_rollout():
    rollouts = controller()
    rollouts.apply("tiny", ROLLOUT.to_json())
    rollouts.apply("tiny", json.dumps({"model": "tiny", "stable": "v1", "candidate": "v1"}).encode())
    rollouts.apply("tiny", b"{broken")
    assert rollouts.rollouts["tiny"] == ROLLOUT
    assert rollouts.route(request()).role is Role.CANDIDATE


def test_deleting_the_document_ends_the_rollout():
    rollouts = controller()
    rollouts.apply("tiny", ROLLOUT.to_json())
    rollouts.apply("tiny", None)
    assert rollouts.route(request()) is None


def test_a_full_read_drops_models_no_longer_stored():
    rollouts = controller()
    rollouts.replace_all({"tiny": ROLLOUT.to_json(), "big": Rollout("big", "a", "b").to_json()})
    rollouts.replace_all({"big": Rollout("big", "a", "b").to_json()})
    assert set(rollouts.rollouts) == {"big"}


def test_only_a_running_candidate_is_measured():
    rollouts = controller()
    rollouts.apply("tiny", ROLLOUT.to_json())
    for _ in range(5):
        rollouts.observe("tiny", "v1", False)  # the stable version: not judged
        rollouts.observe("other", "v2", False)
    assert rollouts.reading("tiny").requests == 0
    for _ in range(5):
        rollouts.observe("tiny", "v2", False)
    reading = rollouts.reading("tiny")
    assert reading.requests == 5 and reading.verdict is Verdict.ROLLBACK
    rollouts.apply("tiny", ROLLOUT.decided(Phase.ROLLED_BACK, "gate").to_json())
    assert rollouts.reading("tiny") is None


def test_a_weight_change_keeps_the_samples_but_a_new_candidate_starts_afresh():
    rollouts = controller()
    rollouts.apply("tiny", ROLLOUT.to_json())
    rollouts.observe("tiny", "v2", True, 10.0)
    rollouts.apply("tiny", Rollout("tiny", "v1", "v2", weight=50.0).to_json())
    assert rollouts.reading("tiny").requests == 1
    rollouts.apply("tiny", Rollout("tiny", "v1", "v3", weight=50.0).to_json())
    assert rollouts.reading("tiny").requests == 0


@pytest.mark.asyncio
async def test_mirrors_are_dropped_when_none_can_start():
    registry = BlockedRegistry()
    rollouts = controller(registry)
    rollouts.mirrors.max_concurrent = 1
    rollouts.apply("tiny", Rollout("tiny", "v1", "v2", mirror_percent=100.0).to_json())
    worker = WorkerRecord("w1", "127.0.0.1:1", "tiny", "v2", capacity=2)
    deadline = asyncio.get_running_loop().time() + 5
    assert rollouts.mirror(request("r1"), lambda version: None, deadline) is None  # no idle worker
    first = rollouts.mirror(request("r2"), lambda version: worker, deadline)
    assert first is not None
    assert rollouts.mirror(request("r3"), lambda version: worker, deadline) is None  # busy: dropped
    await rollouts.stop()
    assert not rollouts.mirrors.tasks


def test_token_agreement_counts_equal_positions_over_the_longer_answer():
    assert token_agreement([], []) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == 0.75
    assert token_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert token_agreement([1, 2, 3], []) == 0.0
