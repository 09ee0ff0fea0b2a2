"""The whole local mesh as subprocesses: real etcd, Redis, Kafka broker, router, cache,
backfill and two workers, started by the same launcher as `ballast up`."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ballast.v1 import worker_pb2, worker_pb2_grpc
from services.cli.client import chat_request, collect, open_channel
from services.cli.etcd_view import list_workers
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.config import load_config
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]

PROMPT = "Is the red charger in stock, and what does it cost?"
LEASE_TTL_S = 3


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("mesh"),
        model_dir=tiny_model_dir,
        workers=2,
        lease_ttl_s=LEASE_TTL_S,
        worker_capacity=4,
        overrides={"worker": {"drain_grace_s": 15}},
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


def etcd_config(mesh):
    return load_config(mesh.config_path, environ={}).etcd


async def registered_ids(mesh) -> set[str]:
    return {record.id for record, _ in await list_workers(etcd_config(mesh))}


async def scrape(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
    await writer.drain()
    body = await reader.read()
    writer.close()
    return body.decode()


def metric_value(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_streams_on_workers(workers, tasks: list[asyncio.Task], timeout: float = 30.0) -> None:
    """Until every stream of `tasks` not yet ended is on one of `workers` (their
    `ballast_worker_in_flight`), and one at least is: where a fault must fall on streams a
    worker is producing. On a busy machine the first stream may end before the last starts,
    so a wait for all of them at once could wait for nothing."""
    deadline = time.monotonic() + timeout
    while True:
        on_workers = sum([metric_value(await scrape(w.metrics_port), "ballast_worker_in_flight") for w in workers])
        pending = sum(not task.done() for task in tasks)
        if on_workers >= max(pending, 1):
            return
        assert pending, "every stream ended before one was seen on a worker"
        assert time.monotonic() < deadline, "the streams never reached the workers"
        await asyncio.sleep(0.02)


async def wait_router_forgets(mesh, worker_name: str, timeout: float = 20.0) -> None:
    """Until the router's watch has applied a worker's departure (its lease revoked or
    expired): the worker leaves the router's routing gauge."""
    port = next(s for s in mesh.services if s.name == "router").metrics_port
    deadline = time.monotonic() + timeout
    while any(
        line.startswith("ballast_router_worker_routable{") and f'worker="{worker_name}"' in line
        for line in (await scrape(port)).splitlines()
    ):
        assert time.monotonic() < deadline, f"the router still routes by {worker_name}"
        await asyncio.sleep(0.05)


async def router_routes_to(mesh, names: set[str], timeout: float = 60.0) -> None:
    """Until the router's own routing gauge counts every worker in `names` as routable."""
    port = next(s for s in mesh.services if s.name == "router").metrics_port
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        text = await scrape(port)
        if all(metric_value(text, "ballast_router_worker_routable", worker=name) >= 1 for name in names):
            return
        assert loop.time() < deadline, f"the router does not route to all of {sorted(names)}"
        await asyncio.sleep(0.2)


async def direct_greedy(address: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = worker_pb2.WorkerGenerateRequest(prompt_ids=prompt_ids)
        request.sampling.max_tokens = max_tokens
        request.sampling.temperature = 0.0
        ids = []
        async for event in stub.Generate(request, timeout=30):
            ids.extend(event.tokens.token_ids)
        return ids


async def test_every_service_is_healthy_with_its_dependencies(mesh):
    for service in mesh.services:
        async with open_channel(service.address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service.name
    cache = next(s for s in mesh.services if s.name == "cache")
    backfill = next(s for s in mesh.services if s.name == "backfill")
    assert metric_value(await scrape(cache.metrics_port), "ballast_dependency_up", dependency="redis") == 1
    assert metric_value(await scrape(backfill.metrics_port), "ballast_dependency_up", dependency="kafka") == 1
    assert await registered_ids(mesh) == {w.name for w in mesh.workers()}


async def test_stream_through_router_equals_worker_greedy_output(mesh, router):
    result = await collect(router, chat_request(PROMPT, max_tokens=32, raw_prompt=True), LOCAL_API_KEY)
    from services.router.tokenization import ModelTokenizer

    worker = mesh.workers()[0]
    async with open_channel(worker.address) as channel:
        info = await worker_pb2_grpc.WorkerStub(channel).GetModelInfo(worker_pb2.ModelInfoRequest(), timeout=5)
    prompt_ids = ModelTokenizer.from_model_info(info).tokenizer.encode(PROMPT).ids
    for worker in mesh.workers():
        assert await direct_greedy(worker.address, prompt_ids, 32) == result.token_ids
    assert result.indices == list(range(len(result.token_ids)))
    assert result.text


async def test_sigterm_drain_finishes_in_flight_streams(mesh, router):
    # Long streams on both workers; SIGTERM one worker while it serves some of them.
    requests = [chat_request(f"{PROMPT} #{i}", max_tokens=1200, raw_prompt=True) for i in range(4)]
    references = await asyncio.gather(*(collect(router, r, LOCAL_API_KEY, timeout=60) for r in requests))
    tasks = [asyncio.create_task(collect(router, r, LOCAL_API_KEY, timeout=60)) for r in requests]
    victim = mesh.workers()[0]
    # SIGTERM once every stream has reached a worker (one arriving at a draining worker would
    # rightly move), and the one to drain holds some of them.
    deadline = time.monotonic() + 10
    while True:
        loads = {w.name: metric_value(await scrape(w.metrics_port), "ballast_worker_in_flight") for w in mesh.workers()}
        if sum(loads.values()) >= len(requests) and loads[victim.name] > 0:
            break
        assert time.monotonic() < deadline, f"the streams never all reached the workers: {loads}"
        await asyncio.sleep(0.02)
    held = loads[victim.name]
    os.kill(victim.pid, signal.SIGTERM)
    results = await asyncio.gather(*tasks)
    assert held > 0
    for result, reference in zip(results, references):
        assert_served(reference)
        assert_served(result)
        # Finished where it ran, the draining worker included: no stream moved.
        assert result.finished.resumes == 0
        assert result.token_ids == reference.token_ids
        assert result.indices == list(range(len(result.token_ids)))
    status = await asyncio.to_thread(victim.process.wait, 30)
    assert status == 0
    assert victim.name not in await registered_ids(mesh)
    mesh.restart_service(victim)
    assert victim.name in await registered_ids(mesh)


async def test_killed_worker_gets_no_requests_after_lease_ttl(mesh, router):
    victim, survivor = mesh.workers()
    router_metrics_port = next(s for s in mesh.services if s.name == "router").metrics_port
    victim.process.kill()
    killed_at = time.monotonic()
    while victim.name in await registered_ids(mesh):
        assert time.monotonic() - killed_at < LEASE_TTL_S + 2, "lease did not expire in time"
        await asyncio.sleep(0.1)
    gone_after = time.monotonic() - killed_at
    await wait_router_forgets(mesh, victim.name)
    retries_before = metric_value(await scrape(router_metrics_port), "ballast_router_worker_retries_total")
    survivor_before = metric_value(await scrape(survivor.metrics_port), "ballast_worker_requests_total")
    # One after another: this is about where requests go, not about admission under load.
    results = [
        await collect(router, chat_request(f"{PROMPT} {i}", max_tokens=8, raw_prompt=True), LOCAL_API_KEY)
        for i in range(10)
    ]
    assert not any(r.finished.degradation for r in results)
    assert all(r.finished is not None for r in results)
    try:
        assert metric_value(await scrape(router_metrics_port), "ballast_router_worker_retries_total") == retries_before
        assert (
            metric_value(await scrape(survivor.metrics_port), "ballast_worker_requests_total") == survivor_before + 10
        )
        assert gone_after <= LEASE_TTL_S + 2
    finally:
        await asyncio.to_thread(mesh.restart_service, victim)
    assert victim.name in await registered_ids(mesh)


async def _wait_metric(port: int, name: str, value: float, timeout: float = 15.0, **labels) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric_value(await scrape(port), name, **labels) == value:
            return True
        await asyncio.sleep(0.2)
    return False


async def _health(address: str) -> int:
    async with open_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def _wait_health(address: str, status: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await _health(address) == status:
            return True
        await asyncio.sleep(0.2)
    return False


async def test_etcd_loss_keeps_serving_and_recovers(mesh, router):
    router_service = next(s for s in mesh.services if s.name == "router")
    worker = mesh.workers()[0]
    await asyncio.to_thread(mesh.etcd.stop)
    try:
        assert await _wait_metric(router_service.metrics_port, "ballast_dependency_up", 0, dependency="etcd")
        assert await _wait_metric(worker.metrics_port, "ballast_dependency_up", 0, dependency="etcd")
        # The router keeps routing on the last membership it saw.
        result = await collect(router, chat_request(PROMPT, max_tokens=8, raw_prompt=True), LOCAL_API_KEY)
        assert_served(result)
    finally:
        await asyncio.to_thread(mesh.etcd.restart)
    # Every part of a process shares one etcd session, and each failed call while etcd was away
    # dropped its client (cutting the calls of the other parts still on it): back, the session
    # reconnects and every watch resyncs within a reconnect backoff or two (5 s at most each).
    assert await _wait_metric(router_service.metrics_port, "ballast_dependency_up", 1, timeout=20, dependency="etcd")
    assert await _wait_metric(worker.metrics_port, "ballast_dependency_up", 1, timeout=20, dependency="etcd")
    deadline = time.monotonic() + 30
    while await registered_ids(mesh) != {w.name for w in mesh.workers()}:
        assert time.monotonic() < deadline, "workers did not re-register after etcd returned"
        await asyncio.sleep(0.2)
    result = await collect(router, chat_request(PROMPT, max_tokens=8, raw_prompt=True), LOCAL_API_KEY)
    assert_served(result)


@pytest.mark.parametrize("dependency, service_name", [("redis", "cache"), ("kafka", "backfill")])
async def test_storage_loss_is_reported_and_recovered(mesh, dependency, service_name):
    service = next(s for s in mesh.services if s.name == service_name)
    server = mesh.redis if dependency == "redis" else mesh.kafka
    await asyncio.to_thread(server.stop)
    try:
        assert await _wait_health(service.address, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await _wait_metric(service.metrics_port, "ballast_dependency_up", 0, dependency=dependency)
        assert service.process.alive()
    finally:
        await asyncio.to_thread(server.restart)
    assert await _wait_health(service.address, health_pb2.HealthCheckResponse.SERVING, timeout=30)
    assert await _wait_metric(service.metrics_port, "ballast_dependency_up", 1, timeout=30, dependency=dependency)
