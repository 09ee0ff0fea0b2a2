"""A session outlives the worker that served it: the whole local mesh as subprocesses, the
worker of turn 1 is killed (SIGKILL) once its KV is saved, and turn 2, served by the other
worker through the router, restores the session's prefix from the cache service and streams
exactly the tokens a full recompute gives."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from ballast.v1 import common_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.cli.client import chat_request, collect, open_channel
from services.cli.etcd_view import list_workers
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from tests.integration.test_mesh import metric_value, scrape
from services.common.config import load_config
from services.common.processes import free_port
from services.router.tokenization import ModelTokenizer

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]

TURN1 = ("The customer paid for the winter coat with Apple Pay. Support answered the question about "
         "the running shoes. We shipped the coffee maker to the new address. ") * 3


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    cache_port = free_port()
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("kv-mesh"),
        model_dir=tiny_model_dir,
        workers=2,
        lease_ttl_s=3,
        worker_capacity=4,
        cache_port=cache_port,
        overrides={"worker": {"cache_address": f"127.0.0.1:{cache_port}", "kv_block_tokens": 16}},
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def router(mesh):
    async with open_channel(mesh.router_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def wait_metric(port: int, name: str, at_least: float, timeout: float = 20.0, **labels) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if metric_value(await scrape(port), name, **labels) >= at_least:
                return True
        except OSError:
            pass
        await asyncio.sleep(0.2)
    return False


async def recompute(address: str, text: str, max_tokens: int) -> list[int]:
    """Greedy tokens straight from a worker without a session: nothing restored."""
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        tokenizer = ModelTokenizer.from_model_info(await stub.GetModelInfo(worker_pb2.ModelInfoRequest()))
        request = worker_pb2.WorkerGenerateRequest(
            prompt_ids=tokenizer.tokenizer.encode(text).ids,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0))
        ids: list[int] = []
        async for event in stub.Generate(request, timeout=60):
            ids.extend(event.tokens.token_ids)
        return ids


async def test_next_turn_after_a_kill9_restores_on_the_other_worker(mesh, router):
    for worker in mesh.workers():
        assert await wait_metric(worker.metrics_port, "ballast_dependency_up", 1, dependency="kvcache")
    turn1 = await collect(router, chat_request(TURN1, max_tokens=24, raw_prompt=True, session_id="kv-it"),
                          LOCAL_API_KEY)
    assert turn1.finished is not None
    served = [w for w in mesh.workers()
              if metric_value(await scrape(w.metrics_port), "ballast_worker_requests_total") > 0]
    assert len(served) == 1
    victim = served[0]
    survivor = next(w for w in mesh.workers() if w is not victim)
    assert await wait_metric(victim.metrics_port, "ballast_worker_kv_saves_total", 1, outcome="saved")

    victim.process.kill()
    etcd = load_config(mesh.config_path, environ={}).etcd
    deadline = time.monotonic() + 15
    while victim.name in {record.id for record, _ in await list_workers(etcd)}:
        assert time.monotonic() < deadline, "the killed worker's lease did not expire"
        await asyncio.sleep(0.2)

    text2 = TURN1 + turn1.text + " Then the customer asked about the refund."
    turn2 = await collect(router, chat_request(text2, max_tokens=24, raw_prompt=True, session_id="kv-it"),
                          LOCAL_API_KEY)
    assert turn2.finished is not None
    metrics = await scrape(survivor.metrics_port)
    assert metric_value(metrics, "ballast_worker_kv_prefix_tokens_total", source="cache") >= 16 * 4
    assert metric_value(metrics, "ballast_worker_kv_lookups_total", result="hit") >= 1
    assert turn2.token_ids == await recompute(survivor.address, text2, 24)
