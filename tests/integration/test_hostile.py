"""A hostile client against a real mesh (router, simulated workers, etcd, Redis, broker): schema
bombs in every bounded keyword, catastrophic patterns, huge enums, deep nesting, 10^5 messages
on gRPC and HTTP, oversized messages, and the largest requests the limits let through.

Each case asserts a defined answer (INVALID_ARGUMENT / 400, or a normal answer) within a
bound; the router's event loop answering a concurrent health check (gRPC) or /v1/models
(HTTP) within 100 ms the whole time; each worker's peak memory grown by under 256 MB; no
worker process lost or restarted (same PIDs); and a normal request served right after."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import grpc
import httpx
import psutil
import pytest

from ballast.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from bench.hostile import BOMBS, LEGAL_CONTENT, chat, http_chat_body, schema_request
from bench.loop_probe import LoopProbe
from services.cli.client import chat_request, collect, open_channel
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

STALL_BOUND_S = 0.100
RSS_BOUND = 256 << 20
ANSWER_BOUND_S = 20.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("hostile"),
        model_dir=tiny_model_dir,
        workers=2,
        engine="sim",
        worker_capacity=4,
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM): a spike between two readings shows."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return psutil.Process(pid).memory_info().rss


@dataclass
class Outcome:
    status: str  # "invalid_argument" / "400" / "served"
    message: str
    seconds: float


async def grpc_case(stub, request) -> Outcome:
    started = time.perf_counter()
    try:
        result = await collect(stub, request, LOCAL_API_KEY, timeout=ANSWER_BOUND_S)
    except grpc.aio.AioRpcError as error:
        return Outcome(error.code().name.lower(), error.details() or "", time.perf_counter() - started)
    assert_served(result)
    return Outcome("served", result.text, time.perf_counter() - started)


@pytest.fixture(scope="module")
def health(mesh):
    """Health checks of the router from a process of its own, all through the module."""
    with LoopProbe.grpc(mesh.router_address) as probe:
        yield probe


@pytest.fixture(scope="module")
def models_probe(mesh):
    """GET /v1/models from a process of its own, all through the module."""
    with LoopProbe.http(f"{mesh.http_base_url}/models", LOCAL_API_KEY) as probe:
        yield probe


class Window:
    """The stretch of time a hostile request ran, to read the probe's slowest answer in it."""

    def __init__(self, probe: LoopProbe) -> None:
        self.probe = probe
        self.worst = 0.0

    async def __aenter__(self) -> "Window":
        self.start = time.monotonic()
        return self

    async def __aexit__(self, *exc) -> None:
        self.worst = await asyncio.to_thread(self.probe.worst, self.start, time.monotonic())


@pytest.fixture
async def http(mesh):
    async with httpx.AsyncClient(
        base_url=mesh.http_base_url, headers={"x-api-key": LOCAL_API_KEY}, timeout=ANSWER_BOUND_S
    ) as client:
        yield client


async def assert_unharmed(mesh, router, pids: dict[str, int], peaks: dict[str, int]) -> None:
    """No worker lost or restarted, none grew by the bound, and a normal request is served."""
    for worker in mesh.workers():
        assert worker.pid == pids[worker.name] and worker.process.alive(), f"{worker.name} was restarted or died"
        grown = _peak_rss(worker.pid) - peaks[worker.name]
        assert grown < RSS_BOUND, f"{worker.name} peak memory grew by {grown >> 20} MB"
    result = await collect(
        router,
        chat_request("Is the blue kettle in stock?", max_tokens=8, allow_degraded=False),
        LOCAL_API_KEY,
        timeout=ANSWER_BOUND_S,
    )
    assert_served(result)
    assert len(result.token_ids) == 8


def state(mesh) -> tuple[dict[str, int], dict[str, int]]:
    workers = mesh.workers()
    return {w.name: w.pid for w in workers}, {w.name: _peak_rss(w.pid) for w in workers}


@pytest.mark.parametrize("case", sorted(BOMBS))
async def test_a_schema_bomb_is_refused_at_the_router(mesh, router, health, case):
    schema, limit = BOMBS[case]
    pids, peaks = state(mesh)
    async with Window(health) as probe:
        outcome = await grpc_case(router, schema_request(schema))
    assert outcome.status == "invalid_argument", outcome
    assert limit in outcome.message and "response_format" in outcome.message
    assert outcome.seconds < 5
    assert probe.worst < STALL_BOUND_S, f"the router's loop was held {probe.worst * 1000:.0f} ms"
    await assert_unharmed(mesh, router, pids, peaks)


async def test_a_worker_refuses_a_bomb_from_a_router_that_did_not_check(mesh, router):
    """Defense in depth: the bomb sent straight to a worker, as a router of another version
    might, fails that one request with INVALID_ARGUMENT before any grammar is built."""
    pids, peaks = state(mesh)
    worker = mesh.workers()[0]
    async with open_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for schema, _limit in (BOMBS["min_items"], BOMBS["nested_quantifiers"], BOMBS["ref_laughs"]):
            request = worker_pb2.WorkerGenerateRequest(
                request_id="hostile",
                prompt_ids=[5, 6, 7],
                response_format=json.dumps(schema),
                sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0),
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _event in stub.Generate(request, timeout=ANSWER_BOUND_S):
                    pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "response_format" in caught.value.details()
    await assert_unharmed(mesh, router, pids, peaks)


@pytest.mark.parametrize(
    "case, request_of, words",
    [
        # Over the request's byte limit too (the roles alone are 10 bytes a message): either refuses.
        ("100k_messages", lambda: chat(100_000, ""), "the limit is"),
        ("20k_messages", lambda: chat(20_000, ""), "router.limits.max_messages"),
        ("huge_message", lambda: chat(1, "x" * 150_000), "router.limits.max_message_chars"),
        ("prompt_over_limit", lambda: chat(4, "word " * 19_000), "the limit is 200000"),
    ],
)
async def test_oversized_conversations_are_refused_without_holding_the_loop(
    mesh, router, health, case, request_of, words
):
    pids, peaks = state(mesh)
    request = request_of()
    async with Window(health) as probe:
        outcome = await grpc_case(router, request)
    assert outcome.status == "invalid_argument", outcome
    assert words in outcome.message, outcome
    assert probe.worst < STALL_BOUND_S, f"the router's loop was held {probe.worst * 1000:.0f} ms"
    await assert_unharmed(mesh, router, pids, peaks)


async def test_the_largest_legal_conversation_is_answered_without_holding_the_loop(mesh, router, health):
    """2048 messages of 90 characters (184k characters, every limit met): rendered, tokenized
    and cut to the model's context on a thread, then answered normally."""
    pids, peaks = state(mesh)
    request = chat(2048, LEGAL_CONTENT)
    async with Window(health) as probe:
        outcome = await grpc_case(router, request)
    assert outcome.status == "served", outcome
    assert probe.worst < STALL_BOUND_S, f"the router's loop was held {probe.worst * 1000:.0f} ms"
    await assert_unharmed(mesh, router, pids, peaks)


async def test_a_large_legal_schema_is_answered(mesh, router, health):
    props = {f"field_{i}": {"type": "string", "maxLength": 20} for i in range(600)}
    schema = {"type": "object", "properties": props, "required": ["field_0"]}
    pids, peaks = state(mesh)
    async with Window(health) as probe:
        outcome = await grpc_case(router, schema_request(schema))
    assert outcome.status == "served", outcome
    assert probe.worst < STALL_BOUND_S, f"the router's loop was held {probe.worst * 1000:.0f} ms"
    await assert_unharmed(mesh, router, pids, peaks)


async def _http_case(http, body: bytes) -> tuple[int, dict, float]:
    started = time.perf_counter()
    response = await http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    return response.status_code, response.json(), time.perf_counter() - started


async def test_a_four_megabyte_chat_body_is_refused_while_models_answers(mesh, router, http, models_probe):
    """120,000 empty messages: 3.96 MB of JSON, under the body limit."""
    body = http_chat_body(120_000)
    assert len(body) < 4 << 20
    pids, peaks = state(mesh)

    async with Window(models_probe) as probe:
        status, answer, seconds = await _http_case(http, body)
    assert status == 400 and "max_messages" in answer["error"]["message"], answer
    assert seconds < ANSWER_BOUND_S
    assert probe.worst < STALL_BOUND_S, f"/v1/models waited {probe.worst * 1000:.0f} ms"
    await assert_unharmed(mesh, router, pids, peaks)


async def test_deep_content_and_a_bomb_over_http_are_400(mesh, router, http):
    pids, peaks = state(mesh)
    deep = {"model": "tiny", "messages": [{"role": "user", "content": json.loads("[" * 200 + "]" * 200)}]}
    status, answer, _ = await _http_case(http, json.dumps(deep).encode())
    assert status == 400, answer
    bomb = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "list"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BOMBS["min_items"][0]}},
    }
    status, answer, _ = await _http_case(http, json.dumps(bomb).encode())
    assert status == 400 and "max_items" in answer["error"]["message"], answer
    await assert_unharmed(mesh, router, pids, peaks)
