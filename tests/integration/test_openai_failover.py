"""A worker killed with SIGKILL while it streams an answer over the OpenAI-compatible HTTP
front: the SSE stream goes on from another worker, and the text the client assembles equals
the uninterrupted gRPC answer, no gap and nothing repeated; the last chunk counts the resume.
With every worker gone mid-answer, the stream ends with an error event in OpenAI's shape and
then `[DONE]`, as SDKs expect."""

from __future__ import annotations

import asyncio
import json

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
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("openai-failover"),
        model_dir=tiny_model_dir,
        workers=2,
        lease_ttl_s=3,
        worker_capacity=4,
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


async def test_an_sse_stream_continues_without_a_gap_when_its_worker_is_killed(mesh, router):
    reference = await collect(
        router, chat_request(PROMPT, max_tokens=TOKENS, raw_prompt=True), LOCAL_API_KEY, timeout=120
    )
    assert_served(reference)
    assert len(reference.token_ids) == TOKENS
    async with openai.AsyncOpenAI(base_url=mesh.http_base_url, api_key=LOCAL_API_KEY, max_retries=0) as client:
        stream = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            extra_headers={"x-ballast-allow-degraded": "false"},
        )
        text, chunks, killed, last = "", 0, False, None
        async for chunk in stream:
            last = chunk
            if chunk.choices and chunk.choices[0].text:
                text += chunk.choices[0].text
                chunks += 1
            if chunks >= 10 and not killed:
                loads = {
                    w.name: metric_value(await scrape(w.metrics_port), "ballast_worker_in_flight")
                    for w in mesh.workers()
                }
                victim = next((w for w in mesh.workers() if loads[w.name] > 0), None)
                assert victim is not None, f"no worker holds the stream any more: {loads}"
                victim.process.kill()
                killed = True
    assert killed
    assert text == reference.text
    extras = last.model_extra["ballast"]
    assert extras["resumes"] >= 1 and extras["degradation"] == "none"
    await asyncio.to_thread(mesh.restart_service, victim)


async def test_an_error_after_the_stream_began_is_an_sse_error_event_then_done(mesh):
    import httpx

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {LOCAL_API_KEY}", "x-ballast-allow-degraded": "false"}
    events: list[str] = []
    async with httpx.AsyncClient(base_url=mesh.http_base_url, timeout=60) as client:
        async with client.stream("POST", "/completions", json=body, headers=headers) as reply:
            assert reply.status_code == 200
            texts, killed = 0, False
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if '"text"' in line:
                    texts += 1
                if texts >= 10 and not killed:
                    for worker in mesh.workers():  # nowhere left to resume
                        worker.process.kill()
                    killed = True
    assert killed
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] and error["message"] and error["type"]
    assert not any('"error"' in event for event in events[:-2])
