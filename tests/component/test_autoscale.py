"""The autoscaler in process against a real etcd: warm standby workers stay out of routing
until promoted, the elected leader promotes them, records its decisions and exports the
gauge, and a second router takes over when the leader resigns."""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import grpc
import pytest

from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request, collect
from services.common.config import TelemetryConfig
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.membership import MembershipWatcher, make_client
from services.common.telemetry import Telemetry
from services.router.app import create_server as create_router
from services.router.autoscale.controller import AutoscalerController, decision_key
from services.router.autoscale.executor import RoleExecutor
from services.router.autoscale.observer import RouterObservations
from services.worker.app import create_server as create_worker
from tests.component.conftest import API_KEY, make_config
from tests.polling import poll

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(120)]

PROMPT = "Where is my order? I paid for a blue phone case yesterday."
# Two serving replicas at least: with one serving and one warm, the leader must promote.
POLICY = '{"primary": {"min_replicas": 2, "max_replicas": 3, "min_samples": 5}}'


async def _read_decision(config, pool: str) -> dict | None:
    client = make_client(config.etcd)
    await client.connect()
    try:
        result = await client.get(decision_key(config.etcd.prefix, pool).encode())
        return None if result is None else json.loads(result.value)
    finally:
        await client.close()


def _gauge(telemetry: Telemetry, pool: str) -> float | None:
    match = re.search(rf'^ballast_desired_replicas\{{pool="{pool}"\}} (\S+)$', telemetry.render(), re.MULTILINE)
    return None if match is None else float(match.group(1))


async def test_a_warm_standby_takes_no_traffic_until_the_leader_promotes_it(etcd_server, tiny_model_dir):
    prefix = f"/ballast-test-{uuid.uuid4().hex[:8]}/"
    serving = await create_worker(make_config(etcd_server, tiny_model_dir, prefix, BALLAST__WORKER__ID="serving-1"))
    warm = await create_worker(
        make_config(etcd_server, tiny_model_dir, prefix, BALLAST__WORKER__ID="warm-1", BALLAST__WORKER__STANDBY="true")
    )
    router = await create_router(make_config(etcd_server, tiny_model_dir, prefix))
    leader = None
    try:
        assert await router.membership.wait_for(lambda w: {"serving-1", "warm-1"} <= set(w), timeout=15)
        record = router.membership.get("warm-1")
        assert record.standby and not record.healthy and not record.routable
        assert not router.servicer.pools.has_capacity(
            "tiny", excluding={k for k in [router.servicer.pools.key_for("serving-1")] if k}
        )

        async with grpc.aio.insecure_channel(router.address, options=CHANNEL_OPTIONS) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            # Eight at once against a capacity of four: with the standby out of routing they
            # queue on the serving worker (or degrade); none reaches the warm one.
            results = await asyncio.gather(
                *(collect(stub, chat_request(PROMPT, max_tokens=12, raw_prompt=True), API_KEY) for _ in range(8))
            )
            assert all(r.finished is not None for r in results)
            assert serving.state.served >= 4 and warm.state.served == 0

            # A router whose elected autoscaler wants two serving replicas promotes the standby.
            config = make_config(
                etcd_server,
                tiny_model_dir,
                prefix,
                BALLAST__AUTOSCALER__ENABLED="true",
                BALLAST__AUTOSCALER__TICK_S="0.5",
                BALLAST__AUTOSCALER__POOLS=POLICY,
            )
            leader = await create_router(config)
            assert await leader.autoscaler.lock.wait_leader(15)
            promoted = await poll(lambda: (r := router.membership.get("warm-1")) is not None and r.routable, 20)
            assert promoted, "the leader did not promote the warm standby"
            assert warm.standby.promoted_in_s is not None

            decision = await _read_decision(config, "primary")
            assert decision["leader"] == leader.autoscaler.router_id
            assert decision["current"] == {"serving": 2, "standby": 0} or decision["action"] == "scale_out"
            assert await poll(lambda: _gauge(leader.telemetry, "primary") == 2.0, 10)

            before = warm.state.served
            await asyncio.gather(
                *(collect(stub, chat_request(PROMPT, max_tokens=12, raw_prompt=True), API_KEY) for _ in range(8))
            )
            assert warm.state.served > before, "the promoted worker took no request"
    finally:
        if leader is not None:
            await leader.shutdown(grace_s=1.0)
        await router.shutdown(grace_s=1.0)
        await warm.shutdown(grace_s=1.0)
        await serving.shutdown(grace_s=1.0)


def _controller(config, router_id: str, membership: MembershipWatcher) -> tuple[AutoscalerController, Telemetry]:
    telemetry = Telemetry(router_id, TelemetryConfig(enabled=False))
    observations = RouterObservations(config.autoscaler.policy(), lambda _model: "primary")
    controller = AutoscalerController(
        config, router_id, membership, observations, RoleExecutor(config.etcd), telemetry.meter
    )
    return controller, telemetry


async def test_one_router_decides_and_another_takes_over_when_it_resigns(etcd_server, tiny_model_dir):
    prefix = f"/ballast-test-{uuid.uuid4().hex[:8]}/"
    config = make_config(
        etcd_server,
        tiny_model_dir,
        prefix,
        BALLAST__AUTOSCALER__ENABLED="true",
        BALLAST__AUTOSCALER__TICK_S="0.3",
        BALLAST__AUTOSCALER__LEADER_TTL_S="2",
        BALLAST__AUTOSCALER__POOLS=POLICY,
    )
    telemetry = Telemetry("membership", TelemetryConfig(enabled=False))
    membership = MembershipWatcher(config.etcd, telemetry.dependencies)
    await membership.start()
    a, a_metrics = _controller(config, "router-a", membership)
    b, b_metrics = _controller(config, "router-b", membership)
    await a.start()
    try:
        assert await a.lock.wait_leader(10)
        await b.start()
        # No worker at all: below min_replicas, the leader asks for two.
        assert await poll(lambda: a.ticks >= 2, 15)
        decision = await _read_decision(config, "primary")
        assert decision["leader"] == "router-a" and decision["action"] == "scale_out"
        assert decision["serving"] == 2 and decision["current"] == {"serving": 0, "standby": 0}
        assert "below min_replicas" in decision["reason"]
        assert _gauge(a_metrics, "primary") == 2.0
        assert not b.lock.is_leader and b.ticks == 0 and _gauge(b_metrics, "primary") is None

        # Both routers publish their windows; the leader reads them all.
        assert await poll(lambda: b.board.published.is_set(), 10)
        client = make_client(config.etcd)
        await client.connect()
        try:
            routers = {r.router for r in await a.board.read_all(client)}
        finally:
            await client.close()
        assert routers == {"router-a", "router-b"}

        await a.stop()
        assert await b.lock.wait_leader(10), "router-b did not take over after router-a resigned"
        assert await poll(lambda: b.ticks >= 1, 10)
        assert (await _read_decision(config, "primary"))["leader"] == "router-b"
        assert _gauge(b_metrics, "primary") == 2.0
    finally:
        await a.stop()
        await b.stop()
        await membership.stop()
