"""The whole local mesh on a Redis Cluster (three masters with a replica each, `ballast up
--redis-cluster`): a session's KV is saved to and restored from the cluster, and a master
killed (SIGKILL) while the backfill stores and pushes answers is replaced by its replica with
no answer lost or pushed twice, and sessions still restore their KV afterwards."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import pytest_asyncio

from ballast.v1 import common_pb2
from services.cli.client import chat_request, collect
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.router.degrade.handoff import HandOff, HandOffSettings
from tests.integration.test_backfill_delivery import get_backfill, hand_off, pushes, stored_count
from tests.integration.test_kv_session import TURN1, recompute, wait_lease_gone, wait_metric, worker_counters
from tests.integration.test_mesh import metric_value, scrape

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

BACKFILL_PREFIX = "ballast:backfill:"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    overrides = {
        "worker": {"kv_block_tokens": 16},
        "degrade": {"delivery_timeout_s": 5},
        # Quick group joins and retries, so the test stays short.
        "backfill": {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000, "retry_backoff_s": 0.5,
                     "replay_concurrency": 4, "subscribe_poll_s": 0.5, "delivery_timeout_s": 5,
                     "redis_prefix": BACKFILL_PREFIX},
    }
    spec = MeshSpec(state_dir=tmp_path_factory.mktemp("cluster-mesh"), model_dir=tiny_model_dir, workers=2,
                    worker_capacity=4, redis_cluster=True, overrides=overrides)
    running = Mesh(spec).start()
    yield running
    running.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def handoff(mesh, tmp_path):
    """Hands records to the mesh's broker the way a router does."""
    handoff = HandOff(HandOffSettings(outbox_path=tmp_path / "outbox.sqlite", bootstrap=mesh.kafka.bootstrap,
                                      delivery_timeout_s=5))
    await handoff.start()
    yield handoff
    await handoff.stop()


async def served_by(mesh, before: dict) -> str:
    """The one worker whose request count moved since `before` (it counts once its stream ended)."""
    deadline = time.monotonic() + 15
    while True:
        after = await worker_counters(mesh)
        served = [name for name in after if after[name][0] > before[name][0]]
        if served or time.monotonic() > deadline:
            assert len(served) == 1, f"served by {served}"
            return served[0]
        await asyncio.sleep(0.2)


async def turn_on_a_fresh_worker(mesh, router, text: str, session: str) -> tuple[str, float, str, float]:
    """One greedy turn of `session`; checks it was served (not degraded) with the tokens a
    recompute gives. Returns the answer's text, the prefix tokens restored from the cache, the
    worker that served it and its count of saved sessions before the turn."""
    before = await worker_counters(mesh)
    answer = await collect(router, chat_request(text, max_tokens=16, raw_prompt=True, session_id=session,
                                                allow_degraded=False), LOCAL_API_KEY)
    assert answer.finished is not None and answer.finished.degradation == common_pb2.DEGRADATION_NONE
    name = await served_by(mesh, before)
    server = next(w for w in mesh.workers() if w.name == name)
    assert answer.token_ids == await recompute(server.address, text, 16)
    restored = (await worker_counters(mesh))[name][2] - before[name][2]
    return answer.text, restored, name, before[name][3]


async def save_then_lose_the_worker(mesh, name: str, saves_before: float) -> None:
    """Waits until worker `name` saved the turn's KV, then kills it (SIGKILL) and brings it back
    empty, so the next turn runs where the session was never seen."""
    server = next(w for w in mesh.workers() if w.name == name)
    assert await wait_metric(server.metrics_port, "ballast_worker_kv_saves_total", saves_before + 1,
                             outcome="saved")
    server.process.kill()
    await wait_lease_gone(mesh, name)
    await asyncio.to_thread(mesh.restart_service, server)


async def test_a_session_restores_its_kv_from_the_cluster(mesh, router):
    session = f"cluster-kv-{uuid.uuid4().hex[:6]}"
    text = TURN1
    answer, _, name, saves = await turn_on_a_fresh_worker(mesh, router, text, session)
    await save_then_lose_the_worker(mesh, name, saves)

    text += answer + " Then the customer asked about the refund for the coat."
    _, restored, _, _ = await turn_on_a_fresh_worker(mesh, router, text, session)
    assert restored >= 16, "the second turn recomputed instead of restoring from the cluster"
    # The cache saw the cluster whole throughout.
    cache = next(s for s in mesh.services if s.name == "cache")
    metrics = await scrape(cache.metrics_port)
    assert metric_value(metrics, "ballast_cache_redis_cluster_ok") == 1
    assert metric_value(metrics, "ballast_cache_redis_cluster_masters", state="reachable") == 3


async def test_a_master_killed_mid_batch_loses_and_repeats_no_answer(mesh, router, handoff):
    cluster = mesh.redis
    # A session's KV saved before the failover.
    session = f"failover-kv-{uuid.uuid4().hex[:6]}"
    text = TURN1.replace("winter coat", "rain jacket")
    answer, _, name, saves = await turn_on_a_fresh_worker(mesh, router, text, session)

    stored_before = await stored_count(mesh)
    sessions = [f"failover-{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
    tickets = [await hand_off(handoff, sessions[i % 6], f"Where is parcel {i}?", max_tokens=96) for i in range(30)]
    deadline = time.monotonic() + 90
    while await stored_count(mesh) - stored_before < 3:
        assert time.monotonic() < deadline, "the backfill did not start on the batch"
        await asyncio.sleep(0.02)
    # The master of the last ticket's answer: the batch still has to write there.
    victim = cluster.master_for_key(f"{BACKFILL_PREFIX}{{{tickets[-1]}}}:answer")
    replica = cluster.replica_of(victim)
    victim.kill()
    done_at_kill = await stored_count(mesh) - stored_before
    assert done_at_kill < len(tickets), "the batch was over before the kill"
    await asyncio.to_thread(cluster.wait_healthy, 60)
    assert cluster.roles()[replica.name] == "master"

    pushed = await pushes(router, sessions, len(tickets), timeout_s=180)
    assert sorted(pushed) == sorted(tickets), "each ticket pushed exactly once"
    for ticket in tickets:
        assert (await get_backfill(router, ticket)).ticket == ticket

    # The session saved before the failover still restores (its blocks were on the replicas).
    await save_then_lose_the_worker(mesh, name, saves)
    text += answer + " Next they wanted the running shoes in a larger size."
    _, restored, _, _ = await turn_on_a_fresh_worker(mesh, router, text, session)
    assert restored >= 16, "the turn after the failover recomputed instead of restoring"

    # The old master comes back as a replica of the promoted one.
    await asyncio.to_thread(victim.start)
    await asyncio.to_thread(cluster.wait_healthy, 60)
    assert cluster.roles()[victim.name] == "replica"
