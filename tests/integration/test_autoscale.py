"""The autoscaler with its local executor: real etcd, real worker processes it starts itself.

A router (in process, elected leader) holds a pool with a 300 ms p99 TTFT target and one
sequence at a time per worker. The load step is sized from the service time measured in the
same test (enough closed-loop clients to queue each request about three targets long, doubled
if that still does not breach), so it breaches on a fast machine and on a slow one alike; the
leader adds capacity: a cold-started worker process, or, with a warm standby kept, a promotion.
Each test checks that the new capacity becomes routable and takes requests, and prints how long
that took from the scale-out decision (bench/scale.py measures it properly).
"""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager

import pytest

from ballast.v1 import inference_pb2_grpc
from bench.load_step import ClosedLoopLoad, clients_for_queue_wait, grow_until, median_service_ms
from services.cli.client import api_key_metadata, chat_request, collect, open_channel
from services.router.app import create_server as create_router
from services.router.autoscale.decision import Action
from tests.component.conftest import API_KEY, make_config
from tests.polling import poll

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(150)]

PROMPT = "Customer asks where order 7041 is and when it ships."
MAX_TOKENS = 24
TARGET_MS = 300
# The step queues each request about this many targets long; a breach without it is luck.
STEP_WAIT_TARGETS = 3
# Seconds without a breach before the load doubles (the pool's 10 s scale-out cooldown fits).
PATIENCE_S = 15


def policy(standby: int) -> str:
    # At most two replicas: one serving plus, on a breach, either a cold start or the standby.
    return (
        '{"primary": {"min_replicas": 1, "max_replicas": 2, '
        f'"target_p99_ttft_ms": {TARGET_MS}, "calm_p99_ttft_ms": {TARGET_MS // 2}, '
        '"min_samples": 10, "latency_window_s": 8, "scale_out_cooldown_s": 10, '
        f'"calm_for_s": 600, "standby_replicas": {standby}}}}}'
    )


def autoscaled_config(etcd_server, model_dir, state_dir, standby: int):
    return make_config(
        etcd_server,
        model_dir,
        f"/ballast-test-{uuid.uuid4().hex[:8]}/",
        BALLAST__WORKER__MAX_CONCURRENCY="1",
        BALLAST__WORKER__DRAIN_GRACE_S="2",
        BALLAST__AUTOSCALER__ENABLED="true",
        BALLAST__AUTOSCALER__EXECUTOR="local",
        BALLAST__AUTOSCALER__TICK_S="0.5",
        BALLAST__AUTOSCALER__POOLS=policy(standby),
        BALLAST__AUTOSCALER__LOCAL__STATE_DIR=str(state_dir),
        BALLAST__AUTOSCALER__LOCAL__STOP_GRACE_S="5",
    )


@asynccontextmanager
async def load_step(address: str):
    """A closed-loop load sized from the service time measured now, with the pool unloaded."""
    async with open_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        service_ms = await median_service_ms(
            lambda: collect(stub, chat_request(PROMPT, max_tokens=MAX_TOKENS, raw_prompt=True), API_KEY)
        )
        clients = clients_for_queue_wait(service_ms, STEP_WAIT_TARGETS * TARGET_MS, slots=1)
        print(f"\nservice time {service_ms:.0f} ms unloaded: a load step of {clients} clients")
        load = ClosedLoopLoad(stub, api_key_metadata(API_KEY), PROMPT, MAX_TOKENS)
        load.grow(clients)
        try:
            yield load
        finally:
            await load.finish()


def serving_ids(router) -> set[str]:
    return {w.id for w in router.membership.workers().values() if w.routable}


def standby_ids(router) -> set[str]:
    return {w.id for w in router.membership.workers().values() if w.standby}


def scale_out(router):
    decision = router.autoscaler.decisions.get("primary")
    return decision if decision is not None and decision.action is Action.SCALE_OUT and decision.serving >= 2 else None


async def test_a_load_step_breaches_the_p99_and_a_cold_started_worker_serves(etcd_server, tiny_model_dir, tmp_path):
    router = await create_router(autoscaled_config(etcd_server, tiny_model_dir, tmp_path, standby=0))
    try:
        assert await router.autoscaler.lock.wait_leader(15)
        # Below min_replicas: the leader cold-starts the first worker itself.
        assert await poll(lambda: len(serving_ids(router)) == 1, 60), "the first worker never served"
        first = serving_ids(router)
        async with load_step(router.address) as load:
            assert await grow_until(load, lambda: scale_out(router) is not None, PATIENCE_S), (
                f"the load step never breached, even at {load.clients} clients"
            )
            decision = scale_out(router)
            # The breach is the load's doing (its latency or its growing queue), not a floor or a surge.
            assert "p99 TTFT" in decision.reason or "queue wait growing" in decision.reason, decision.reason
            assert await poll(lambda: len(serving_ids(router)) == 2, 60), "the new worker never became routable"
            serving_after = time.time() - decision.at
            (new,) = serving_ids(router) - first
            # It takes requests: its heartbeat shows work in flight while the load runs.
            assert await poll(lambda: router.membership.get(new).in_flight > 0, 15), "the new worker took no request"
        print(f"\ncold start: {serving_after:.2f}s from the scale-out decision to routable")
    finally:
        await router.shutdown(grace_s=1.0)
    assert not router.autoscaler.executor.children, "worker processes outlived the router"


async def test_a_warm_standby_is_promoted_on_a_breach_and_serves(etcd_server, tiny_model_dir, tmp_path):
    router = await create_router(autoscaled_config(etcd_server, tiny_model_dir, tmp_path, standby=1))
    try:
        assert await router.autoscaler.lock.wait_leader(15)
        assert await poll(lambda: len(serving_ids(router)) == 1 and len(standby_ids(router)) == 1, 60), (
            "the pool never reached one serving and one warm worker"
        )
        (warm,) = standby_ids(router)
        async with load_step(router.address) as load:
            assert await grow_until(load, lambda: scale_out(router) is not None, PATIENCE_S), (
                f"the load step never breached, even at {load.clients} clients"
            )
            decision = scale_out(router)
            assert await poll(lambda: warm in serving_ids(router), 10, interval=0.01), (
                "the warm standby was not promoted"
            )
            promoted_after = time.time() - decision.at
            assert await poll(lambda: router.membership.get(warm).in_flight > 0, 15), (
                "the promoted worker took no request"
            )
            # At max_replicas no warm replacement is started: the pool is serving two, standby none.
            assert (decision.serving, decision.standby) == (2, 0)
            assert len(router.autoscaler.executor.children) == 2
        print(f"\nwarm promotion: {promoted_after:.2f}s from the scale-out decision to routable")
    finally:
        await router.shutdown(grace_s=1.0)
    assert not router.autoscaler.executor.children, "worker processes outlived the router"
