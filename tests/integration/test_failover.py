"""No stream breaks: failover, stalls, breakers, temperature, drain and the retry budget,
against a local mesh of three worker processes with real etcd."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request, collect, open_channel
from services.cli.etcd_view import list_workers
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.worker.keeper import serving_pid
from tests.integration.test_mesh import etcd_config, metric_value, registered_ids, scrape
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]

STREAM_TOKENS = 300
SLOW_START_S = 1.0
PROMPTS = [f"Customer {i} asks about order {1000 + i} and the delivery date." for i in range(20)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("failover"),
        model_dir=tiny_model_dir,
        workers=3,
        lease_ttl_s=3,
        worker_capacity=8,
        worker_test_files=True,
        overrides={
            "worker": {"drain_grace_s": 2},
            "router": {
                "stall": {"s_timeout_s": 1.5, "a_timeout_s": 1.5, "b_timeout_s": 1.5},
                "breaker": {"min_requests": 10, "cooldown_s": 1.0, "window_s": 10.0},
                "retry": {"ratio": 0.5, "min_retries_per_s": 2.0, "max_attempts": 4},
                "scheduling": {"slow_start_s": SLOW_START_S},
            },
        },
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


class References(list):
    """The greedy token ids per prompt, and how long the batch of all of them took: faults
    are timed as fractions of it, so they hit streams in flight on a fast machine and a slow
    one alike."""

    duration_s: float = 0.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def references(mesh):
    """Uninterrupted greedy outputs, one per prompt: computed once, while every worker is
    healthy (a later test leaves breakers open), and never a degraded answer."""
    async with open_channel(mesh.router_address) as channel:
        router = inference_pb2_grpc.InferenceStub(channel)
        started = time.monotonic()
        results = await asyncio.gather(*[
            collect(router, chat_request(p, max_tokens=STREAM_TOKENS, raw_prompt=True, allow_degraded=False),
                    LOCAL_API_KEY)
            for p in PROMPTS
        ])
    found = References(r.token_ids for r in results)
    found.duration_s = time.monotonic() - started
    return found


def router_metrics_port(mesh) -> int:
    return next(s for s in mesh.services if s.name == "router").metrics_port


def assert_streams_match(results, references):
    for result, expected in zip(results, references):
        assert_served(result)
        assert result.token_ids == expected
        assert result.indices == list(range(len(expected)))
        assert result.finished.usage.completion_tokens == len(expected)


async def wait_registered(mesh, names, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not set(names) <= await registered_ids(mesh):
        assert time.monotonic() < deadline, f"{names} did not register"
        await asyncio.sleep(0.2)


async def busiest_worker(mesh):
    """The worker with the most streams in flight now: the router may keep a just-restarted
    worker in slow start, so a fixed choice of victim can hold no stream at all."""
    counts = {}
    for worker in mesh.workers():
        counts[worker.name] = metric_value(await scrape(worker.metrics_port), "ballast_worker_in_flight")
    busiest = max(mesh.workers(), key=lambda w: counts[w.name])
    assert counts[busiest.name] > 0, f"no worker has a stream in flight: {counts}"
    return busiest


async def test_kill9_at_random_points_loses_no_stream(mesh, router, references):
    rng = random.Random(20261129)
    streams = [
        asyncio.create_task(collect(router, chat_request(p, max_tokens=STREAM_TOKENS, raw_prompt=True), LOCAL_API_KEY, timeout=90))
        for p in PROMPTS
    ]
    kills = 0
    for _ in range(2):
        await asyncio.sleep(rng.uniform(0.15, 0.5) * references.duration_s)
        if all(s.done() for s in streams):
            break
        victim = rng.choice(mesh.workers())
        victim.process.kill()
        kills += 1
        await asyncio.to_thread(mesh.restart_service, victim)
    results = await asyncio.gather(*streams)
    assert kills >= 1
    assert_streams_match(results, references)
    assert sum(r.finished.resumes for r in results) >= 1
    await wait_registered(mesh, [w.name for w in mesh.workers()])


async def test_stalled_worker_is_detected_and_streams_resume(mesh, router, references):
    streams = [
        asyncio.create_task(collect(router, chat_request(p, max_tokens=STREAM_TOKENS, raw_prompt=True), LOCAL_API_KEY, timeout=90))
        for p in PROMPTS[:9]
    ]
    await asyncio.sleep(0.2 * references.duration_s)
    victim = await busiest_worker(mesh)
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        results = await asyncio.gather(*streams)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    assert_streams_match(results, references[:9])
    resumed = [r for r in results if r.finished.resumes]
    assert resumed, "no stream was on the stopped worker"
    text = await scrape(router_metrics_port(mesh))
    assert metric_value(text, "ballast_router_resumes_total", reason="stalled") >= 1
    await wait_registered(mesh, [victim.name])


async def test_hot_worker_gets_no_new_requests_until_it_cools(mesh, router):
    hot = mesh.workers()[1]
    temperature = mesh.temperature_file(hot.name)
    temperature.write_text("80")
    await asyncio.sleep(1.5)  # one heartbeat to publish, plus the watch
    before = metric_value(await scrape(hot.metrics_port), "ballast_worker_requests_total")
    await asyncio.gather(*[
        collect(router, chat_request(f"hot {i}", max_tokens=4, raw_prompt=True), LOCAL_API_KEY) for i in range(12)
    ])
    assert metric_value(await scrape(hot.metrics_port), "ballast_worker_requests_total") == before
    temperature.write_text("76")  # between the marks: still hot (hysteresis)
    await asyncio.sleep(1.5)
    await asyncio.gather(*[
        collect(router, chat_request(f"warm {i}", max_tokens=4, raw_prompt=True), LOCAL_API_KEY) for i in range(12)
    ])
    assert metric_value(await scrape(hot.metrics_port), "ballast_worker_requests_total") == before
    temperature.write_text("74")
    await asyncio.sleep(1.5)
    await asyncio.gather(*[
        collect(router, chat_request(f"cool {i}", max_tokens=4, raw_prompt=True), LOCAL_API_KEY) for i in range(12)
    ])
    assert metric_value(await scrape(hot.metrics_port), "ballast_worker_requests_total") > before


async def test_rolling_sigterm_restart_breaks_no_stream(mesh, router, references):
    stop = asyncio.Event()
    outcomes: list = []

    async def client(k: int) -> None:
        i = k
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            result = await collect(router, chat_request(prompt, max_tokens=STREAM_TOKENS, raw_prompt=True), LOCAL_API_KEY, timeout=90)
            outcomes.append((result.token_ids == references[i % len(PROMPTS)], result.finished.resumes))
            i += 3

    clients = [asyncio.create_task(client(k)) for k in range(6)]
    for worker in list(mesh.workers()):
        await asyncio.sleep(0.5)
        os.kill(worker.pid, signal.SIGTERM)
        assert await asyncio.to_thread(worker.process.wait, 30) == 0
        await asyncio.to_thread(mesh.restart_service, worker)
    stop.set()
    await asyncio.gather(*clients)
    assert outcomes and all(same for same, _ in outcomes)
    await wait_registered(mesh, [w.name for w in mesh.workers()])


async def worker_lease(mesh, name: str) -> int | None:
    records = await list_workers(etcd_config(mesh))
    return next((record.lease_id for record, _ in records if record.id == name), None)


async def test_a_respawning_worker_killed_mid_stream_is_back_under_its_id_at_once(mesh, router, references):
    kept = await asyncio.to_thread(mesh.start_worker, {"BALLAST__WORKER__RESPAWN": "true"})
    first = serving_pid(kept.pid)
    assert first not in (None, kept.pid)
    lease_before = await worker_lease(mesh, kept.name)
    await asyncio.sleep(SLOW_START_S)  # a full share of the streams, not a newcomer's
    # Enough calls for its breaker to judge it (the mesh's breaker.min_requests is 10).
    await asyncio.gather(*[
        collect(router, chat_request(f"warm {i}", max_tokens=2, raw_prompt=True), LOCAL_API_KEY) for i in range(48)
    ])
    streams = [
        asyncio.create_task(collect(router, chat_request(p, max_tokens=STREAM_TOKENS, raw_prompt=True), LOCAL_API_KEY, timeout=90))
        for p in PROMPTS
    ]
    # Kill it while it serves streams that are under way (read from its in-flight gauge: the
    # router may place fewer streams on it than on the others).
    deadline = time.monotonic() + references.duration_s + 5
    while metric_value(await scrape(kept.metrics_port), "ballast_worker_in_flight") < 1:
        assert time.monotonic() < deadline, "the respawning worker got no stream"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1 * references.duration_s)
    killed_at = time.monotonic()
    os.kill(first, signal.SIGKILL)
    results = await asyncio.gather(*streams)
    assert_streams_match(results, references)
    assert sum(r.finished.resumes for r in results) >= 1  # the kill broke streams
    # The keeper started a fresh worker, registered under the same id with a new lease,
    # without anyone restarting anything and well before the old lease could expire.
    while (lease := await worker_lease(mesh, kept.name)) in (None, lease_before):
        assert time.monotonic() - killed_at < 20, "the respawned worker did not register"
        await asyncio.sleep(0.1)
    second = serving_pid(kept.pid)
    assert second not in (None, first) and kept.process.alive()
    # Its streams broke because it died, not because it answered with errors: its breaker
    # stays closed and the fresh process is routable at once.
    assert await breaker_state(mesh, kept.name) == 0
    probe = chat_request("probe", max_tokens=4, raw_prompt=True)
    assert len((await collect(router, probe, LOCAL_API_KEY)).token_ids) == 4
    # SIGTERM reaches the worker through the keeper: it drains and both exit cleanly.
    assert await asyncio.to_thread(kept.process.stop, 30) == 0
    assert not Path(f"/proc/{second}").exists()


async def breaker_state(mesh, worker_name: str) -> float:
    return metric_value(await scrape(router_metrics_port(mesh)), "ballast_breaker_state", worker=worker_name)


async def test_breaker_opens_on_worker_errors_not_on_client_errors(mesh, router):
    # Workers restarted by the tests before get their full share of requests first (slow start).
    await asyncio.sleep(SLOW_START_S)
    # A flood of bad requests: client errors never count against workers.
    for _ in range(30):
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(router, chat_request("x", max_tokens=0, raw_prompt=True), LOCAL_API_KEY)
    for worker in mesh.workers():
        assert await breaker_state(mesh, worker.name) == 0

    faulty = mesh.workers()[2]
    fault = mesh.fault_file(faulty.name)
    fault.write_text("unavailable")
    try:
        results = []
        for i in range(30):
            results.append(await collect(router, chat_request(f"q {i}", max_tokens=4, raw_prompt=True), LOCAL_API_KEY))
        for result in results:  # retried elsewhere, and answered by the model
            assert_served(result)
        assert await breaker_state(mesh, faulty.name) == 2  # open
    finally:
        fault.unlink()
    deadline = time.monotonic() + 20
    while await breaker_state(mesh, faulty.name) != 0:
        assert time.monotonic() < deadline, "breaker did not close after the worker recovered"
        await asyncio.gather(*[
            collect(router, chat_request(f"probe {i}", max_tokens=2, raw_prompt=True), LOCAL_API_KEY) for i in range(6)
        ])
        await asyncio.sleep(0.3)


async def test_retry_budget_caps_attempts_when_every_worker_fails(mesh, router):
    port = router_metrics_port(mesh)
    retries_before = metric_value(await scrape(port), "ballast_router_worker_retries_total")
    for worker in mesh.workers():
        mesh.fault_file(worker.name).write_text("unavailable")
    requests = 20
    try:
        started = time.monotonic()
        codes = []
        for i in range(requests):
            try:
                doomed = chat_request(f"doomed {i}", max_tokens=4, raw_prompt=True, allow_degraded=False)
                await collect(router, doomed, LOCAL_API_KEY, timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        elapsed = time.monotonic() - started
    finally:
        for worker in mesh.workers():
            mesh.fault_file(worker.name).unlink(missing_ok=True)
    assert set(codes) == {grpc.StatusCode.UNAVAILABLE}
    retries = metric_value(await scrape(port), "ballast_router_worker_retries_total") - retries_before
    # At most max_attempts - 1 retries each, and the budget caps the total well below that.
    assert retries <= requests * 3
    assert retries <= 0.5 * requests + 2.0 * 10 + 1
    assert elapsed < 10  # failing fast, not waiting out deadlines

