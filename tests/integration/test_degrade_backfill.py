"""Degradation and backfill across the local mesh: every service a process, real etcd, Redis and
Kafka broker. A degraded request handed off (as a router does) is replayed by the backfill
process through the router on a real worker and pushed once to a subscriber of the router.
When the router runs the degradation ladder (a `degrade` section in the shared config), the
whole path is checked too: primary pool gone → light-model pool → rules, each marked, each
backfilled once the primary pool is back."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import grpc
import pytest

from ballast.v1 import backfill_pb2, common_pb2
from services.cli.client import chat_request, collect
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.common.degraded.codec import degraded_request_pb, kafka_key, make_ticket
from services.common.degraded.codec import Level
from services.common.generation import Sampling
from services.router.degrade.handoff import HandOff, HandOffSettings
from services.router.requests import InferenceRequest
from tests.integration.test_mesh import wait_router_forgets

# The mesh (and the tiny model on first use) take a while to start on a busy machine.
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(400)]

BACKFILL_KEY = "backfill-internal-key"
LIGHT_MODEL = "tiny-light"
PROMPT = "Is the red charger in stock, and what does it cost?"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    overrides = {"degrade": {"ladders": {"tiny": [LIGHT_MODEL, "rules"]}, "delivery_timeout_s": 5}}
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("degrade"),
        model_dir=tiny_model_dir,
        workers=1,
        lease_ttl_s=3,
        worker_capacity=4,
        # The backfill replays through the router with its own internal key.
        api_keys={LOCAL_API_KEY: "local", BACKFILL_KEY: "ballast-backfill"},
        overrides=overrides,
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


async def first_answer(stub, timeout_s: float = 90.0, **target) -> backfill_pb2.BackfilledAnswer:
    call = stub.Subscribe(
        backfill_pb2.SubscribeRequest(**target), metadata=(("x-api-key", LOCAL_API_KEY),), timeout=timeout_s
    )
    try:
        async for answer in call:
            return answer
    finally:
        call.cancel()
    raise AssertionError("subscription ended without an answer")


async def test_handed_off_request_is_replayed_by_the_backfill_process(mesh, router, tmp_path):
    handoff = HandOff(
        HandOffSettings(outbox_path=tmp_path / "outbox.sqlite", bootstrap=mesh.kafka.bootstrap, delivery_timeout_s=5)
    )
    await handoff.start()
    try:
        session = f"s-{uuid.uuid4().hex[:8]}"
        request = InferenceRequest(
            request_id=uuid.uuid4().hex,
            session_id=session,
            tenant="local",
            model="tiny",
            sampling=Sampling(max_tokens=24, temperature=0.0),
            tier="A",
            prompt=PROMPT,
        )
        ticket = make_ticket("local", request.request_id)
        record = degraded_request_pb(
            request,
            ticket=ticket,
            tier="A",
            level=Level.RULES,
            reason="admission",
            degraded_text="quick answer",
            degraded_by="rules",
            received_at=time.time(),
        )
        # Subscribed through the router, which relays from the backfill service.
        subscription = asyncio.create_task(first_answer(router, session_id=session))
        await handoff.submit(kafka_key(session, ticket), record.SerializeToString())
        answer = await subscription
    finally:
        await handoff.stop()
    direct = await collect(router, chat_request(PROMPT, max_tokens=24, raw_prompt=True), LOCAL_API_KEY)
    assert answer.ticket == ticket and answer.text == direct.text
    assert list(answer.token_ids) == direct.token_ids


async def test_primary_down_degrades_to_light_then_rules_and_backfills_when_back(mesh, router):
    primary = mesh.workers()[0]
    light = mesh.start_worker(extra_env={"BALLAST__WORKER__POOL": "light", "BALLAST__WORKER__MODEL_NAME": LIGHT_MODEL})
    expected = await collect(router, chat_request(PROMPT, max_tokens=16, raw_prompt=True), LOCAL_API_KEY)
    os.kill(primary.pid, signal.SIGTERM)
    await asyncio.to_thread(primary.process.wait, 30)
    await wait_router_forgets(mesh, primary.name)

    session = f"s-{uuid.uuid4().hex[:8]}"
    degraded = await collect(
        router, chat_request(PROMPT, max_tokens=16, raw_prompt=True, session_id=session), LOCAL_API_KEY
    )
    assert degraded.started.model == LIGHT_MODEL
    assert degraded.finished.degradation == common_pb2.DEGRADATION_LIGHT_MODEL
    ticket = degraded.finished.backfill_ticket
    assert ticket

    os.kill(light.pid, signal.SIGTERM)
    await asyncio.to_thread(light.process.wait, 30)
    await wait_router_forgets(mesh, light.name)  # the light worker's lease goes too
    ruled = await collect(router, chat_request("我的手机壳有货吗？", max_tokens=16, session_id=session), LOCAL_API_KEY)
    assert ruled.finished.degradation == common_pb2.DEGRADATION_RULES and ruled.finished.backfill_ticket
    assert "手机壳" in ruled.text

    # Nothing better can come while the primary pool is down; it comes once it is back.
    waiting = asyncio.create_task(first_answer(router, ticket=ticket, timeout_s=120))
    await asyncio.sleep(3)
    assert not waiting.done()
    primary = await asyncio.to_thread(mesh.restart_service, primary)
    answer = await waiting
    assert answer.text == expected.text and answer.degraded_level == common_pb2.DEGRADATION_LIGHT_MODEL
    ruled_answer = await first_answer(router, ticket=ruled.finished.backfill_ticket)
    assert ruled_answer.degraded_level == common_pb2.DEGRADATION_RULES and ruled_answer.text

    # allow_degraded=false: the client gets the error instead.
    os.kill(primary.pid, signal.SIGTERM)
    await asyncio.to_thread(primary.process.wait, 30)
    await wait_router_forgets(mesh, primary.name)
    strict = chat_request(PROMPT, max_tokens=8, raw_prompt=True)
    strict.allow_degraded = False
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(router, strict, LOCAL_API_KEY)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    await asyncio.to_thread(mesh.restart_service, primary)
