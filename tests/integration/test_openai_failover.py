"""A worker killed with SIGKILL while it streams an answer over the OpenAI-compatible HTTP
front: the SSE stream goes on from another worker, and the text the client assembles equals
the uninterrupted gRPC answer, no gap and nothing repeated; the last chunk counts the resume."""

from __future__ import annotations

import asyncio

import openai
import pytest

from services.cli.client import chat_request, collect
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from tests.integration.test_mesh import metric_value, scrape
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]

PROMPT = "Customer 77 asks where order 7077 is and when it will reach the warehouse."
TOKENS = 1200


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    spec = MeshSpec(state_dir=tmp_path_factory.mktemp("openai-failover"), model_dir=tiny_model_dir, workers=2,
                    lease_ttl_s=3, worker_capacity=4)
    running = Mesh(spec).start()
    yield running
    running.stop()


async def test_an_sse_stream_continues_without_a_gap_when_its_worker_is_killed(mesh, router):
    reference = await collect(router, chat_request(PROMPT, max_tokens=TOKENS, raw_prompt=True), LOCAL_API_KEY,
                              timeout=120)
    assert_served(reference)
    assert len(reference.token_ids) == TOKENS
    async with openai.AsyncOpenAI(base_url=mesh.http_base_url, api_key=LOCAL_API_KEY, max_retries=0) as client:
        stream = await client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True,
            extra_headers={"x-ballast-allow-degraded": "false"})
        text, chunks, killed, last = "", 0, False, None
        async for chunk in stream:
            last = chunk
            if chunk.choices and chunk.choices[0].text:
                text += chunk.choices[0].text
                chunks += 1
            if chunks >= 10 and not killed:
                loads = {w.name: metric_value(await scrape(w.metrics_port), "ballast_worker_in_flight")
                         for w in mesh.workers()}
                victim = next(w for w in mesh.workers() if loads[w.name] > 0)
                victim.process.kill()
                killed = True
    assert killed
    assert text == reference.text
    extras = last.model_extra["ballast"]
    assert extras["resumes"] >= 1 and extras["degradation"] == "none"
    await asyncio.to_thread(mesh.restart_service, victim)
