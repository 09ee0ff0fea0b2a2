"""Sixteen simulated workers (`worker.engine: sim`), each its own process with a real gRPC
server registered in etcd, behind the router: streams spread over them, and when some are
killed with SIGKILL mid-stream every stream still equals its uninterrupted reference token
for token (the sim's tokens depend on the position only, as a seeded real engine's do)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.cli.client import chat_request, collect
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from tests.integration.test_mesh import metric_value, scrape
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

WORKERS = 16
STREAMS = 32
TOKENS = 150  # about 1.5 s per stream with the default profile


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    spec = MeshSpec(state_dir=tmp_path_factory.mktemp("sim-mesh"), model_dir=tiny_model_dir, workers=WORKERS,
                    engine="sim", lease_ttl_s=3, worker_capacity=4)
    running = Mesh(spec).start()
    yield running
    running.stop()


def request(i: int, seeded: bool):
    options = {"temperature": 0.8, "seed": 100 + i} if seeded else {}
    return chat_request(f"Customer {i} asks about order {3000 + i}.", max_tokens=TOKENS, raw_prompt=True,
                        allow_degraded=False, **options)


async def test_streams_survive_sim_workers_killed_mid_stream(mesh, router):
    keys = [(i, i % 2 == 1) for i in range(STREAMS)]
    references = await asyncio.gather(*(collect(router, request(i, s), LOCAL_API_KEY, timeout=120) for i, s in keys))
    for reference in references:
        assert_served(reference)
        assert len(reference.token_ids) == TOKENS
    streams = [asyncio.create_task(collect(router, request(i, s), LOCAL_API_KEY, timeout=120)) for i, s in keys]
    # Until the streams are under way on at least four workers (16 processes share this
    # machine's cores: how long that takes depends on it).
    deadline = time.monotonic() + 30
    while True:
        loads = {w.name: metric_value(await scrape(w.metrics_port), "ballast_worker_in_flight") for w in mesh.workers()}
        busy = [w for w in mesh.workers() if loads[w.name] > 0]
        if len(busy) >= 4:
            break
        assert time.monotonic() < deadline, f"the streams did not spread over the workers: {loads}"
        assert not all(s.done() for s in streams), "every stream ended before four workers were busy"
        await asyncio.sleep(0.05)
    victims = busy[:4]
    for victim in victims:
        victim.process.kill()
    results = await asyncio.gather(*streams)
    for result, reference in zip(results, references):
        assert_served(result)
        assert result.token_ids == reference.token_ids
        assert result.indices == list(range(TOKENS))
    assert sum(r.finished.resumes for r in results) >= len(victims)
