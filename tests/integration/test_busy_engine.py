"""A first token late on a busy engine is not held against the request; on a wedged one it is.

A mesh of three sim workers whose router quarantines a request at the first worker it costs
(`max_workers_lost: 1`) and waits five seconds for a first token. All three run two hundred
times slower than their profile: a long prompt's prefill takes several seconds, in chunks of 64
tokens (a step each, a quarter of a second apart), and relays nothing. The request's first
token is late on one worker, then on another; each worker's engine kept stepping, and said so
over its Relay stream until the stall, so neither loss counts: the workers run at speed again,
the third serves the request, and nothing is quarantined. (Without the engine's word, the
router sees a worker that relayed it nothing for five seconds and quarantines the request at
once.) Then another long prompt's prefill begins on a worker, which hangs right after its
first step: the engine said it moved, but not in the last `engine_quiet_s` before the stall,
so the request is quarantined at its first worker, as a query of death that wedged the engine
would be.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request, collect, open_channel
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.common.etcd_client import make_client
from services.common.faults import REASON_KEY
from services.config import load_config
from services.worker.sim import SimProfile, faults_key
from tests.integration.test_failover import router_metrics_port
from tests.integration.test_mesh import metric_value, registered_ids, scrape
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

FIRST_TOKEN_TIMEOUT_S = 5.0
# A report of the engine's progress counts if it came this long before a stall at the most.
ENGINE_QUIET_S = 1.5
# Every sim wait this many times longer: a 64-token prefill chunk takes a quarter of a second,
# the first (with the prefill's base time) over a second, a prompt of some 1,500 tokens seven.
SLOWDOWN = 200
PROFILE = SimProfile(source="tests: short prefill chunks", prefill_chunk_tokens=64)
LONG_PROMPT = " ".join(f"Parcel {i} left the depot at dawn and reached the hub by noon." for i in range(36))
OTHER_LONG_PROMPT = " ".join(f"Invoice {i} was paid late, and the customer asked for a refund." for i in range(34))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    state_dir = tmp_path_factory.mktemp("busy-engine")
    profile = state_dir / "sim-profile.json"
    profile.write_text(json.dumps(PROFILE.to_dict()))
    spec = MeshSpec(
        state_dir=state_dir,
        model_dir=tiny_model_dir,
        workers=3,
        engine="sim",
        worker_capacity=4,
        overrides={
            "worker": {"engine_progress_ms": 200, "sim_profile": str(profile)},
            "router": {
                # A tier-A request waits for its first token the longer of the two.
                "first_token_timeout_s": FIRST_TOKEN_TIMEOUT_S,
                "stall": {"a_timeout_s": FIRST_TOKEN_TIMEOUT_S},
                "quarantine": {"max_workers_lost": 1, "engine_quiet_s": ENGINE_QUIET_S},
                "retry": {"max_attempts": 8},
                "scheduling": {"slow_start_s": 0},
            },
        },
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


async def counter(mesh, name: str, **labels: str) -> float:
    return metric_value(await scrape(router_metrics_port(mesh)), name, **labels)


def faults_applied(mesh) -> int:
    """How many times the workers took new fault knobs (each logs it)."""
    return sum(worker.process.log_path.read_text(errors="replace").count("sim faults now") for worker in mesh.workers())


async def set_faults(mesh, client, etcd, faults: dict | None) -> None:
    """Sets (None: clears) every worker's fault knobs and waits until each took them."""
    before = faults_applied(mesh)
    for worker in mesh.workers():
        key = faults_key(etcd.prefix, worker.name).encode()
        if faults is None:
            await client.delete(key)
        else:
            await client.put(key, json.dumps(faults).encode())
    deadline = time.monotonic() + 30
    while faults_applied(mesh) < before + len(mesh.workers()):
        assert time.monotonic() < deadline, f"the workers never took the fault knobs {faults}"
        await asyncio.sleep(0.05)


@pytest.fixture
async def knobs(mesh):
    """The etcd settings and a client for the workers' fault knobs, cleared afterwards."""
    etcd = load_config(mesh.config_path, environ={}).etcd
    client = make_client(etcd)
    deadline = time.monotonic() + 60
    while {w.name for w in mesh.workers()} - await registered_ids(mesh):
        assert time.monotonic() < deadline, "the workers never registered"
        await asyncio.sleep(0.2)
    try:
        yield etcd, client
    finally:
        for worker in mesh.workers():
            await client.delete(faults_key(etcd.prefix, worker.name).encode())
        await client.close()


async def wait_counter(mesh, answer: asyncio.Task, name: str, at_least: float, **labels: str) -> None:
    """Until the router's counter `name` reaches `at_least`, while `answer` is still coming."""
    deadline = time.monotonic() + 60
    while await counter(mesh, name, **labels) < at_least:
        if answer.done():
            pytest.fail(f"the request ended before {name}{labels} reached {at_least}: {answer.result()}")
        assert time.monotonic() < deadline, f"{name}{labels} never reached {at_least}"
        await asyncio.sleep(0.05)


async def test_a_late_first_token_on_a_busy_engine_moves_the_request_without_holding_it_against_it(mesh, knobs):
    etcd, client = knobs
    quarantined = await counter(mesh, "ballast_router_quarantine_total", event="quarantined")
    stalled = await counter(mesh, "ballast_router_worker_retries_total", reason="stalled")
    await set_faults(mesh, client, etcd, {"slowdown": SLOWDOWN})
    async with open_channel(mesh.router_address) as channel:
        router = inference_pb2_grpc.InferenceStub(channel)
        request = chat_request(LONG_PROMPT, max_tokens=8, allow_degraded=False, request_id="long-prompt")
        answer = asyncio.create_task(collect(router, request, LOCAL_API_KEY, timeout=120))
        # Aimed by the router's own count: late on one worker, then on another; the third
        # takes it once the workers run at speed again.
        await wait_counter(mesh, answer, "ballast_router_worker_retries_total", stalled + 2, reason="stalled")
        await set_faults(mesh, client, etcd, None)
        assert_served(await answer)
    assert await counter(mesh, "ballast_router_quarantine_total", event="quarantined") == quarantined


async def engine_steps(mesh) -> dict[str, float]:
    """Each worker's engine steps (its own count, as its metrics export it)."""
    return {
        worker.name: metric_value(await scrape(worker.metrics_port), "ballast_worker_engine_steps_total")
        for worker in mesh.workers()
    }


async def test_an_engine_that_hangs_after_its_last_report_quarantines_the_request_at_its_first_worker(mesh, knobs):
    etcd, client = knobs
    quarantined = await counter(mesh, "ballast_router_quarantine_total", event="quarantined")
    stalled = await counter(mesh, "ballast_router_worker_retries_total", reason="stalled")
    await set_faults(mesh, client, etcd, {"slowdown": SLOWDOWN})
    before = await engine_steps(mesh)
    async with open_channel(mesh.router_address) as channel:
        router = inference_pb2_grpc.InferenceStub(channel)
        request = chat_request(OTHER_LONG_PROMPT, max_tokens=8, request_id="wedges")
        answer = asyncio.create_task(collect(router, request, LOCAL_API_KEY, timeout=120))
        # Aimed by the engines' own count: the request's first prefill chunk is done, and its
        # worker reports its engine moving; then every engine hangs.
        deadline = time.monotonic() + 60
        while (await engine_steps(mesh)) == before:
            assert time.monotonic() < deadline and not answer.done(), "no engine ever stepped on the request"
            await asyncio.sleep(0.02)
        await set_faults(mesh, client, etcd, {"hang": True})
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await answer
    error = raised.value
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(error.trailing_metadata() or ()).get(REASON_KEY) == "quarantined"
    assert await counter(mesh, "ballast_router_quarantine_total", event="quarantined") == quarantined + 1
    # At its first worker: not moved on to a second one first.
    assert await counter(mesh, "ballast_router_worker_retries_total", reason="stalled") == stalled
