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
from tests.integration.test_mesh import etcd_config, metric_value, registered_ids, router_routes_to, scrape
from tests.integration.victims import Answering, token_counter, worker_answering
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
    """The greedy token ids per prompt, and how long the batch of all of them took (a bound
    for waits; faults are aimed by the workers' own state, see tests.integration.victims)."""

    duration_s: float = 0.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def references(mesh):
    """Uninterrupted greedy outputs, one per prompt: computed once, while every worker is
    healthy (a later test leaves breakers open), and never a degraded answer."""
    async with open_channel(mesh.router_address) as channel:
        router = inference_pb2_grpc.InferenceStub(channel)
        started = time.monotonic()
        results = await asyncio.gather(
            *[
                collect(
                    router,
                    chat_request(p, max_tokens=STREAM_TOKENS, raw_prompt=True, allow_degraded=False),
                    LOCAL_API_KEY,
                )
                for p in PROMPTS
            ]
        )
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


class Progress:
    """Tokens received so far by a batch of streams: the point of the batch a fault waits for,
    not by the clock. The client may read its tokens after the workers generated them, so
    the worker a fault hits is then chosen by its own state (tests.integration.victims)."""

    def __init__(self, streams: int, tokens_each: int) -> None:
        self.received = [0] * streams
        self.tokens_each = tokens_each

    def counter(self, index: int):
        return token_counter(self.received, index)

    def fraction(self) -> float:
        return sum(self.received) / (len(self.received) * self.tokens_each)

    async def until(self, fraction: float, streams: list[asyncio.Task], timeout: float = 60.0) -> bool:
        """Waits until the batch has received `fraction` of its tokens; False if every
        stream ended first."""
        deadline = time.monotonic() + timeout
        while self.fraction() < fraction:
            if all(s.done() for s in streams):
                return False
            assert time.monotonic() < deadline, f"the batch stalled at {self.fraction():.2f} of its tokens"
            await asyncio.sleep(0.01)
        return True


def start_streams(router, prompts, progress: Progress) -> list[asyncio.Task]:
    return [
        asyncio.create_task(
            collect(
                router,
                chat_request(p, max_tokens=STREAM_TOKENS, raw_prompt=True),
                LOCAL_API_KEY,
                timeout=90,
                on_tokens=progress.counter(i),
            )
        )
        for i, p in enumerate(prompts)
    ]


# A batch whose kills hit no stream proves nothing (each victim had just finished its streams
# when the kill landed): another batch runs instead, up to this many.
FAULT_BATCHES = 3


@pytest.mark.timeout(FAULT_BATCHES * 120)
async def test_kill9_at_random_points_loses_no_stream(mesh, router, references):
    rng = random.Random(20261129)
    outcomes: list[dict] = []
    for _batch in range(FAULT_BATCHES):
        on_workers = await Answering.read(mesh.workers())
        progress = Progress(len(PROMPTS), STREAM_TOKENS)
        streams = start_streams(router, PROMPTS, progress)
        kills = 0
        # Two kills at random points of the batch (the first once the client has a random
        # share of its tokens below a third, the second below two thirds), each of a worker in
        # the middle of answering a stream of the batch when it is read, killed at once.
        for low, high in ((0.1, 0.3), (0.4, 0.65)):
            if not await progress.until(rng.uniform(low, high), streams):
                break
            victim = await worker_answering(mesh.workers(), on_workers, streams, rng, progress.received)
            if victim is None:
                break
            victim.process.kill()
            kills += 1
            await asyncio.to_thread(mesh.restart_service, victim)
            on_workers.restarted(victim.name)
        results = await asyncio.gather(*streams)
        assert_streams_match(results, references)
        outcomes.append({"kills": kills, "resumes": sum(r.finished.resumes for r in results)})
        if kills >= 1 and outcomes[-1]["resumes"] >= 1:
            break
    else:
        pytest.fail(f"in {FAULT_BATCHES} batches no kill hit a stream in flight: {outcomes}")
    await wait_registered(mesh, [w.name for w in mesh.workers()])


@pytest.mark.timeout(FAULT_BATCHES * 120)
async def test_stalled_worker_is_detected_and_streams_resume(mesh, router, references):
    # The stop hits a worker in the middle of answering a stream of the batch (a worker the
    # router keeps in slow start may hold none); a batch whose streams the stopped worker had
    # all finished tests nothing: another runs, until one stream was stalled.
    rng = random.Random(20261130)
    for _batch in range(FAULT_BATCHES):
        on_workers = await Answering.read(mesh.workers())
        progress = Progress(9, STREAM_TOKENS)
        streams = start_streams(router, PROMPTS[:9], progress)
        victim = None
        if await progress.until(0.2, streams):
            victim = await worker_answering(mesh.workers(), on_workers, streams, rng, progress.received)
        if victim is None:
            assert_streams_match(await asyncio.gather(*streams), references[:9])
            continue
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            results = await asyncio.gather(*streams)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        assert_streams_match(results, references[:9])
        if any(r.finished.resumes for r in results):
            break
    else:
        pytest.fail(f"no stream was on the stopped worker in {FAULT_BATCHES} batches")
    text = await scrape(router_metrics_port(mesh))
    assert metric_value(text, "ballast_router_resumes_total", reason="stalled") >= 1
    await wait_registered(mesh, [victim.name])


async def wait_routing(mesh, worker: str, reason: str, timeout: float = 15.0) -> None:
    """Until the router's metrics show `worker` out for `reason` ("none": routable again):
    the temperature goes through a heartbeat and the router's watch, as fast as the machine."""
    line_start = "ballast_router_worker_routable{"
    deadline = time.monotonic() + timeout
    while True:
        text = await scrape(router_metrics_port(mesh))
        if any(
            line.startswith(line_start) and f'worker="{worker}"' in line and f'reason="{reason}"' in line
            for line in text.splitlines()
        ):
            return
        assert time.monotonic() < deadline, f"the router never showed {worker} as {reason}"
        await asyncio.sleep(0.1)


async def test_hot_worker_gets_no_new_requests_until_it_cools(mesh, router):
    hot = mesh.workers()[1]
    temperature = mesh.temperature_file(hot.name)
    temperature.write_text("80")
    await wait_routing(mesh, hot.name, "hot")
    before = metric_value(await scrape(hot.metrics_port), "ballast_worker_requests_total")
    await asyncio.gather(
        *[collect(router, chat_request(f"hot {i}", max_tokens=4, raw_prompt=True), LOCAL_API_KEY) for i in range(12)]
    )
    assert metric_value(await scrape(hot.metrics_port), "ballast_worker_requests_total") == before
    temperature.write_text("76")  # between the marks: still hot (hysteresis)
    # The reading reaches the router with the next heartbeat and its watch.
    deadline = time.monotonic() + 15
    while await routed_temperature(mesh, hot.name) != 76:
        assert time.monotonic() < deadline, "the router never saw 76"
        await asyncio.sleep(0.1)
    await wait_routing(mesh, hot.name, "hot")
    await asyncio.gather(
        *[collect(router, chat_request(f"warm {i}", max_tokens=4, raw_prompt=True), LOCAL_API_KEY) for i in range(12)]
    )
    assert metric_value(await scrape(hot.metrics_port), "ballast_worker_requests_total") == before
    temperature.write_text("74")
    await wait_routing(mesh, hot.name, "none")
    # Back from being out, it is in slow start: its share of requests grows over
    # router.scheduling.slow_start_s, so batches go out until it takes one.
    deadline = time.monotonic() + SLOW_START_S + 15
    while metric_value(await scrape(hot.metrics_port), "ballast_worker_requests_total") == before:
        assert time.monotonic() < deadline, "the cooled worker took no request"
        await asyncio.gather(
            *[
                collect(router, chat_request(f"cool {i}", max_tokens=4, raw_prompt=True), LOCAL_API_KEY)
                for i in range(12)
            ]
        )


async def routed_temperature(mesh, name: str) -> float | None:
    text = await scrape(router_metrics_port(mesh))
    for line in text.splitlines():
        if line.startswith("ballast_router_worker_temperature_celsius{") and f'worker="{name}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_rolling_sigterm_restart_breaks_no_stream(mesh, router, references):
    stop = asyncio.Event()
    outcomes: list = []

    async def client(k: int) -> None:
        i = k
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            result = await collect(
                router, chat_request(prompt, max_tokens=STREAM_TOKENS, raw_prompt=True), LOCAL_API_KEY, timeout=90
            )
            outcomes.append((result.token_ids == references[i % len(PROMPTS)], result.finished.resumes))
            i += 3

    clients = [asyncio.create_task(client(k)) for k in range(6)]
    for worker in list(mesh.workers()):
        # Each worker drains with streams of its own in flight (one restarted just before
        # may still be in slow start: the wait lasts until the router trusts it).
        deadline = time.monotonic() + 30
        while metric_value(await scrape(worker.metrics_port), "ballast_worker_in_flight") < 1:
            assert time.monotonic() < deadline, f"{worker.name} never held a stream"
            await asyncio.sleep(0.02)
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


@pytest.mark.timeout(FAULT_BATCHES * 120)
async def test_a_respawning_worker_killed_mid_stream_is_back_under_its_id_at_once(mesh, router, references):
    kept = await asyncio.to_thread(mesh.start_worker, {"BALLAST__WORKER__RESPAWN": "true"})
    first = serving_pid(kept.pid)
    assert first not in (None, kept.pid)
    lease_before = await worker_lease(mesh, kept.name)
    await asyncio.sleep(SLOW_START_S)  # a full share of the streams, not a newcomer's
    # Enough calls for its breaker to judge it (the mesh's breaker.min_requests is 10).
    await asyncio.gather(
        *[collect(router, chat_request(f"warm {i}", max_tokens=2, raw_prompt=True), LOCAL_API_KEY) for i in range(48)]
    )
    # Kill it while it is in the middle of answering a stream of the batch (its own counters,
    # not the router's choice of placement, which may give a newcomer few streams or none),
    # and count the kill as one that hit work in flight only when the router moved a stream
    # off it because it was lost (its own counter; resumed, or retried from the start when
    # the router had relayed none of its tokens yet): a batch it took no stream of, or whose
    # streams it had all finished when the kill landed, tests nothing. Another batch runs
    # then, up to FAULT_BATCHES; each one's outcome is kept for the failure message.
    outcomes: list[str] = []
    for _attempt in range(FAULT_BATCHES):
        baseline = await Answering.read([kept])
        moved_before = await moved_off_lost_workers(mesh)
        streams = start_streams(router, PROMPTS, Progress(len(PROMPTS), STREAM_TOKENS))
        if await worker_answering([kept], baseline, streams, random.Random(0), received=None) is None:
            assert_streams_match(await asyncio.gather(*streams), references)
            outcomes.append("the batch ended before the worker was read answering a stream of it")
            continue
        log_offset = kept.process.log_path.stat().st_size
        killed_at = time.monotonic()
        os.kill(first, signal.SIGKILL)
        results = await asyncio.gather(*streams)
        assert_streams_match(results, references)
        # The keeper started a fresh worker, registered under the same id with a new lease,
        # without anyone restarting anything and well before the old lease could expire.
        while await worker_lease(mesh, kept.name) in (None, lease_before):
            assert time.monotonic() - killed_at < 20, "the respawned worker did not register"
            await asyncio.sleep(0.1)
        # Its READY line: its metrics are served (read again by the next batch) and its ports known.
        await asyncio.to_thread(mesh.await_ready_after, kept, log_offset, 60)
        moved = await moved_off_lost_workers(mesh) - moved_before
        if moved >= 1:  # the kill broke streams in flight
            break
        outcomes.append(f"killed; the router moved no stream ({sum(r.finished.resumes for r in results)} resumed)")
        first, lease_before = serving_pid(kept.pid), await worker_lease(mesh, kept.name)
        # The router counts a worker back under its id as new (slow start): the next batch
        # waits until it takes a full share.
        await router_routes_to(mesh, {kept.name}, timeout=30)
        await asyncio.sleep(SLOW_START_S)
    else:
        pytest.fail(f"the respawning worker was never killed in the middle of an answer: {outcomes}")
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


async def moved_off_lost_workers(mesh) -> float:
    """Requests the router moved to another worker because theirs was lost (resumed or retried
    from the start), counted since it started."""
    text = await scrape(router_metrics_port(mesh))
    return metric_value(text, "ballast_router_worker_retries_total", reason="worker_lost")


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
        deadline = time.monotonic() + 10  # the router's gauges are refreshed four times a second
        while await breaker_state(mesh, faulty.name) != 2:  # open
            assert time.monotonic() < deadline, "the faulty worker's breaker did not open"
            await asyncio.sleep(0.05)
    finally:
        fault.unlink()
    deadline = time.monotonic() + 20
    while await breaker_state(mesh, faulty.name) != 0:
        assert time.monotonic() < deadline, "breaker did not close after the worker recovered"
        await asyncio.gather(
            *[
                collect(router, chat_request(f"probe {i}", max_tokens=2, raw_prompt=True), LOCAL_API_KEY)
                for i in range(6)
            ]
        )
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
