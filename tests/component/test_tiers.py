"""Tier scheduling through the real router and worker: preemption, live rules, admission."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import grpc
import pytest
import pytest_asyncio

from ballast.v1 import common_pb2, inference_pb2_grpc
from services.cli.client import chat_request, collect, open_channel
from services.common.membership import make_client
from services.router.app import create_server as create_router
from services.worker.app import create_server as create_worker
from tests.component.conftest import API_KEY, make_config
from tests.served import assert_served

pytestmark = pytest.mark.asyncio(loop_scope="session")

B_PROMPT = "Please summarise every order of customer 4471 for the archive."
S_PROMPT = "Confirm payment 9001."
# Long enough that B streams still hold both slots when S arrives, on a machine a few times
# faster than this one too (the tiny model's context is 2048).
B_TOKENS = 1500


@pytest.fixture(scope="module")
def prefix():
    return f"/ballast-tiers-{uuid.uuid4().hex[:8]}/"


def tier_config(etcd_server, tiny_model_dir, prefix):
    scheduling = {"tiers": {"S": {"max_queue": 2}, "A": {"max_queue": 1}, "B": {"max_queue": 1}}}
    return make_config(
        etcd_server,
        tiny_model_dir,
        prefix,
        BALLAST__WORKER__MAX_CONCURRENCY="2",
        BALLAST__ROUTER__SCHEDULING=json.dumps(scheduling),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mesh(etcd_server, tiny_model_dir, prefix):
    config = tier_config(etcd_server, tiny_model_dir, prefix)
    worker = await create_worker(config)
    router = await create_router(config)
    assert await router.membership.wait_for(lambda ws: worker.worker_id in ws, timeout=10)
    yield router, worker, config
    await router.shutdown(grace_s=1.0)
    await worker.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(loop_scope="session")
async def stub(mesh):
    router, _, _ = mesh
    async with open_channel(router.address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def b_request(i: int):
    return chat_request(f"{B_PROMPT} #{i}", max_tokens=B_TOKENS, raw_prompt=True, tier="B")


async def test_s_request_preempts_b_and_b_still_completes_exactly(mesh, stub):
    router, worker, _ = mesh
    references = [await collect(stub, b_request(i), API_KEY, timeout=60) for i in range(2)]
    decoding: set[int] = set()
    b_streams = [
        asyncio.create_task(
            collect(stub, b_request(i), API_KEY, timeout=60, on_tokens=lambda _tokens, i=i: decoding.add(i))
        )
        for i in range(2)
    ]
    while worker.state.in_flight < 2 or len(decoding) < 2:  # both slots taken by B, both decoding
        await asyncio.sleep(0.01)
    s_result = await collect(stub, chat_request(S_PROMPT, max_tokens=8, raw_prompt=True, tier="S"), API_KEY, timeout=10)
    # S was served while both B streams still ran: it took a slot from one, it did not wait
    # for one to end (however fast this machine decodes).
    b_running_when_s_ended = not any(t.done() for t in b_streams)
    b_results = await asyncio.gather(*b_streams)
    assert_served(s_result)
    assert b_running_when_s_ended, "S waited for a B stream to end"
    preempted = [r for r in b_results if r.finished.resumes]
    assert preempted, "no B stream was preempted"
    for result, reference in zip(b_results, references):
        assert result.token_ids == reference.token_ids
        assert result.indices == list(range(len(reference.token_ids)))
    assert 'ballast_router_preemptions_total{tier="B"}' in router.telemetry.render()


def queued(router, tier: str) -> float:
    """Requests of `tier` waiting in the router's queue, as its metrics say."""
    line_start = "ballast_router_queue_length{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in router.telemetry.render().splitlines()
        if line.startswith(line_start) and f'tier="{tier}"' in line
    )


async def test_full_queue_refuses_at_once(mesh, stub):
    b_streams = [asyncio.create_task(collect(stub, b_request(10 + i), API_KEY, timeout=60)) for i in range(3)]
    router, worker, _ = mesh
    # Both slots taken, and the third waits in B's queue (bound 1).
    while worker.state.in_flight < 2 or queued(router, "B") < 1:
        await asyncio.sleep(0.01)
    started = time.monotonic()
    refused = b_request(99)
    refused.allow_degraded = False  # the error itself, not a degraded answer
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, refused, API_KEY, timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - started < 5.0  # at once, not after B's 15 s budget
    trailers = dict(err.value.trailing_metadata() or ())
    assert int(trailers["retry-after-ms"]) > 0
    for task in b_streams:
        task.cancel()
    await asyncio.gather(*b_streams, return_exceptions=True)


async def test_rule_change_in_etcd_applies_without_restart(mesh, stub, etcd_server, prefix):
    router, _, config = mesh
    request = chat_request("hello", max_tokens=2, raw_prompt=True)
    request.signals.business_tag = "vip"
    before = await collect(stub, request, API_KEY)
    assert before.started.tier == common_pb2.TIER_A and before.started.tier_reason == "default"
    rules = {
        "version": 1,
        "default": {"tier": "A"},
        "rules": [{"name": "vip-customers", "when": {"business_tag": "vip"}, "tier": "S"}],
    }
    client = make_client(config.etcd)
    await client.connect()
    try:
        await client.put(f"{prefix}config/tiering".encode(), json.dumps(rules).encode())
        deadline = time.monotonic() + 5
        while True:
            after = await collect(stub, request, API_KEY)
            if after.started.tier == common_pb2.TIER_S:
                break
            assert time.monotonic() < deadline, "rule change not applied"
            await asyncio.sleep(0.1)
        assert after.started.tier_reason == "vip-customers"
        # A broken document is refused and the rules in force stay.
        await client.put(f"{prefix}config/tiering".encode(), b"rules: [ {name: 1")
        await asyncio.sleep(0.5)
        still = await collect(stub, request, API_KEY)
        assert still.started.tier == common_pb2.TIER_S
    finally:
        await client.delete(f"{prefix}config/tiering".encode())
        await client.close()
