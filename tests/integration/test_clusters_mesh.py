"""The whole local mesh on clusters (`ballast up --clusters --routers 2`): a Redis Cluster of
three masters with a replica each, a three-member etcd and two routers. A session's KV is
saved to and restored from the Redis Cluster; a Redis master killed (SIGKILL) while the
backfill stores and pushes answers is replaced by its replica with no answer lost or pushed
twice, and sessions still restore their KV afterwards; the etcd leader killed while streams
run breaks no stream and loses no worker's lease, and the member that comes back has them."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from ballast.v1 import common_pb2
from services.cli.client import chat_request, collect
from services.cli.etcd_view import list_workers
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.common.config import EtcdConfig
from services.config import load_config
from tests.integration.test_backfill_delivery import get_backfill, hand_off, pushes, stored_count
from tests.integration.test_kv_session import TURN1, recompute, wait_lease_gone, wait_metric, worker_counters
from tests.integration.test_mesh import metric_value, scrape, wait_streams_on_workers
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

BACKFILL_PREFIX = "ballast:backfill:"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    overrides = {
        "worker": {"kv_block_tokens": 16},
        "degrade": {"delivery_timeout_s": 5},
        # Quick group joins and retries, so the test stays short.
        "backfill": {
            "session_timeout_ms": 6000,
            "heartbeat_interval_ms": 1000,
            "retry_backoff_s": 0.5,
            "replay_concurrency": 4,
            "subscribe_poll_s": 0.5,
            "delivery_timeout_s": 5,
            "redis_prefix": BACKFILL_PREFIX,
        },
    }
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("cluster-mesh"),
        model_dir=tiny_model_dir,
        workers=2,
        worker_capacity=4,
        redis_cluster=True,
        etcd_cluster=True,
        routers=2,
        overrides=overrides,
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


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
    answer = await collect(
        router,
        chat_request(text, max_tokens=16, raw_prompt=True, session_id=session, allow_degraded=False),
        LOCAL_API_KEY,
    )
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
    assert await wait_metric(server.metrics_port, "ballast_worker_kv_saves_total", saves_before + 1, outcome="saved")
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


async def worker_leases(etcd: EtcdConfig) -> dict[str, int]:
    return {record.id: record.lease_id for record, _ in await list_workers(etcd)}


async def test_the_etcd_leader_killed_under_load_breaks_no_stream_and_loses_no_lease(mesh, router):
    etcd = load_config(mesh.config_path, environ={}).etcd
    assert len(etcd.endpoints) == 3
    leases = await worker_leases(etcd)
    assert sorted(leases) == sorted(w.name for w in mesh.workers())

    # Long streams (the tiny model makes 300 tokens in a fifth of a second): the kill must find
    # them running, and the election must fall inside them.
    requests = [
        chat_request(f"Tell me about parcel {i} and its route.", max_tokens=1500, raw_prompt=True) for i in range(4)
    ]
    references = [await collect(router, r, LOCAL_API_KEY, timeout=120) for r in requests]
    tasks = [asyncio.create_task(collect(router, r, LOCAL_API_KEY, timeout=120)) for r in requests]
    await wait_streams_on_workers(mesh.workers(), tasks)

    # Watch the registrations through the election: no worker may drop out.
    missing: list[set[str]] = []
    watching = True

    async def watch() -> None:
        while watching:
            try:
                seen = set(await worker_leases(etcd))
            except Exception:  # noqa: BLE001 - a read during the election may fail; the next one counts
                seen = None
            if seen is not None and seen != set(leases):
                missing.append(set(leases) - seen)
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    leader = mesh.etcd.leader()
    leader.process.kill()
    assert not all(task.done() for task in tasks), "every stream ended before the etcd leader died"
    results = await asyncio.gather(*tasks)
    await asyncio.to_thread(mesh.etcd.wait_healthy, 30)
    # Two lease TTLs after the election: a lease that was not kept alive would be gone by now.
    await asyncio.sleep(2 * mesh.spec.lease_ttl_s)
    watching = False
    await watcher

    for result, reference in zip(results, references):
        assert_served(result)
        assert result.finished.resumes == 0, "a stream broke and moved"
        assert result.token_ids == reference.token_ids
    assert not missing, f"workers dropped out of etcd during the election: {missing}"
    assert await worker_leases(etcd) == leases, "a worker's lease was lost and granted again"

    # The member that comes back holds the same registrations under the same leases.
    await asyncio.to_thread(leader.start)
    await asyncio.to_thread(mesh.etcd.wait_healthy, 30)
    only_the_returned = EtcdConfig(host=leader.host, port=leader.port, prefix=etcd.prefix)
    assert await worker_leases(only_the_returned) == leases
    assert_served(await collect(router, chat_request("Is the red charger in stock?", max_tokens=8), LOCAL_API_KEY))
