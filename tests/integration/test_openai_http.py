"""The router's OpenAI-compatible HTTP front on a real local mesh, through the official
`openai` SDK: the same answers as gRPC, errors in OpenAI's shape, keep-alives while queued,
429 with Retry-After under admission refusal, and a client that leaves frees its worker slot."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import jsonschema
import openai
import pytest

from services.cli.client import chat_request, collect
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.common.degraded.codec import make_ticket
from tests.integration.test_mesh import metric_value, scrape

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]

PROMPT = "Is the red charger in stock, and what does it cost?"
# Near the tiny model's 2048-token context: a stream that lasts seconds.
LONG_TOKENS = 1800
KEEPALIVE_S = 0.2


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    # One worker with two slots and room for one queued B request: admission refusal is cheap.
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("mesh"),
        model_dir=tiny_model_dir,
        workers=1,
        worker_capacity=2,
        overrides={"router": {"http_keepalive_s": KEEPALIVE_S, "scheduling": {"tiers": {"B": {"max_queue": 1}}}}},
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


@pytest.fixture
async def client(mesh):
    async with openai.AsyncOpenAI(base_url=mesh.http_base_url, api_key=LOCAL_API_KEY, max_retries=0) as sdk:
        yield sdk


@pytest.fixture
async def http(mesh):
    async with httpx.AsyncClient(
        base_url=mesh.http_base_url, timeout=60, headers={"Authorization": f"Bearer {LOCAL_API_KEY}"}
    ) as session:
        yield session


async def worker_in_flight(mesh) -> float:
    return metric_value(await scrape(mesh.workers()[0].metrics_port), "ballast_worker_in_flight")


async def wait_in_flight(mesh, predicate, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not predicate(value := await worker_in_flight(mesh)):
        assert time.monotonic() < deadline, f"worker in-flight stayed at {value}"
        await asyncio.sleep(0.05)
    return value


async def test_chat_equals_grpc_answer_streamed_and_not(mesh, router, client):
    reference = await collect(router, chat_request(PROMPT, max_tokens=32), LOCAL_API_KEY)
    whole = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=32, temperature=0
    )
    assert whole.choices[0].message.content == reference.text
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens == len(reference.token_ids)
    assert whole.model_extra["ballast"]["degradation"] == "none"
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=32, temperature=0, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.text
    assert chunks[-1].choices[0].finish_reason is not None and chunks[-1].usage is None
    assert chunks[-1].model_extra["ballast"]["degradation"] == "none"


async def test_completions_equal_grpc_prompt_answer(router, client):
    reference = await collect(router, chat_request(PROMPT, max_tokens=16, raw_prompt=True), LOCAL_API_KEY)
    answer = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    assert answer.choices[0].text == reference.text
    stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == reference.text


async def test_include_usage_adds_a_final_usage_chunk(client):
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


async def test_json_schema_answer_validates(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "in_stock": {"type": "boolean"}},
        "required": ["answer", "in_stock"],
        "additionalProperties": False,
    }
    answer = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=96,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "stock", "schema": schema}},
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    assert answer.model_extra["ballast"]["structured"]["status"] in ("valid", "repaired")


async def test_models_lists_tiny(client):
    assert "tiny" in [model.id async for model in client.models.list()]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return error


async def test_bad_requests_get_openai_errors(http, client):
    assert_error(
        await http.post("/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400
    )
    assert_error(await http.post("/chat/completions", content=b"[" * 200 + b"]" * 200), 400)
    good = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert_error(await http.post("/chat/completions", json={**good, "max_tokens": "four"}), 400, "max_tokens")
    assert_error(await http.post("/chat/completions", json={**good, "messages": "hi"}), 400, "messages")
    assert_error(await http.post("/chat/completions", json={**good, "n": 2}), 400, "n")
    assert_error(await http.post("/chat/completions", json={**good, "tools": [{"type": "function"}]}), 400, "tools")
    assert_error(await http.post("/chat/completions", json={**good, "model": "huge"}), 404)
    assert_error(await http.post("/chat/completions", json=good, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(await http.post("/chat/completions", content=b" " * (5 << 20)), 413)
    assert_error(await http.get(f"/ballast/backfill/{make_ticket('local', 'never-degraded')}"), 404)
    assert_error(await http.get("/ballast/sessions/s-1/backfill", headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)
    assert caught.value.body["param"] == "n"
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="huge", messages=[{"role": "user", "content": "hi"}])


async def test_queued_stream_keeps_alive_and_full_queue_is_429(mesh, router, http):
    holders = [
        asyncio.create_task(
            collect(
                router, chat_request(f"{PROMPT} #{i}", max_tokens=LONG_TOKENS, raw_prompt=True, tier="B"), LOCAL_API_KEY
            )
        )
        for i in range(2)
    ]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    headers = {"x-ballast-tier": "B", "x-ballast-allow-degraded": "false"}
    try:
        await wait_in_flight(mesh, lambda value: value >= 2, timeout=20)
        async with http.stream("POST", "/completions", json=body, headers=headers) as queued:
            assert queued.status_code == 200
            lines = queued.aiter_lines()
            assert await asyncio.wait_for(anext(lines), 5) == ": keep-alive"
            refused = await http.post("/completions", json=body, headers=headers)
            error = assert_error(refused, 429)
            assert error["code"] == "overloaded" and int(refused.headers["Retry-After"]) >= 1
            # The router's gauges are refreshed four times a second.
            deadline = time.monotonic() + 10
            while await router_queued(mesh, "B") != 1:
                assert time.monotonic() < deadline, "the router's queue gauge never showed the queued request"
                await asyncio.sleep(0.05)
        # Its client left before its first token: the request leaves the router's queue.
        deadline = time.monotonic() + 10
        while await router_queued(mesh, "B") > 0:
            assert time.monotonic() < deadline, "the queued request stayed after its client left"
            await asyncio.sleep(0.05)
        assert not any(task.done() for task in holders)
    finally:
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    await wait_in_flight(mesh, lambda value: value == 0, timeout=10)


async def cancelled_on_worker(mesh) -> float:
    text = await scrape(mesh.workers()[0].metrics_port)
    return metric_value(text, "ballast_worker_requests_total", outcome="cancelled")


async def test_client_leaving_frees_the_worker_slot(mesh, http):
    # A raw prompt (the chat-trained model ends a chat answer on its own within tokens),
    # greedy (a sampled answer may draw the end-of-sequence token after a few tokens and end
    # before the client leaves), at tier B, allowed no degraded answer: the worker answers
    # for as long as the context allows.
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0}
    headers = {"x-ballast-tier": "B", "x-ballast-allow-degraded": "false"}
    await wait_in_flight(mesh, lambda value: value == 0, timeout=10)
    cancelled = await cancelled_on_worker(mesh)
    # Not streamed: the client gives up while the worker generates; the worker stops as well.
    waiting = asyncio.create_task(http.post("/completions", json=body, headers=headers))
    await wait_in_flight(mesh, lambda value: value == 1, timeout=15)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    # Freed long before the answer would have ended (it lasts seconds here); the bound only
    # keeps a broken cancellation from hanging the test.
    await wait_in_flight(mesh, lambda value: value == 0, timeout=10)
    # Streamed: the client leaves once the stream began. Its 200 and headers go out with the
    # first tokens event (a text chunk may come later: the tiny model's first tokens can
    # decode to nothing), so the stream is under way; the client leaves while the worker
    # still holds the request.
    async with http.stream("POST", "/completions", json={**body, "stream": True}, headers=headers) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        assert response.headers["Content-Type"] == "text/event-stream"
        await wait_in_flight(mesh, lambda value: value == 1, timeout=15)
    await wait_in_flight(mesh, lambda value: value == 0, timeout=10)
    # The worker counts a request's outcome as its stream closes, next to freeing the slot.
    deadline = time.monotonic() + 10
    while await cancelled_on_worker(mesh) < cancelled + 2:
        assert time.monotonic() < deadline, "the worker did not count both requests as cancelled"
        await asyncio.sleep(0.05)
    assert await cancelled_on_worker(mesh) == cancelled + 2


async def router_queued(mesh, tier: str) -> float:
    router = next(s for s in mesh.services if s.name == "router")
    return metric_value(await scrape(router.metrics_port), "ballast_router_queue_length", tier=tier)


async def router_refused(mesh, tier: str) -> float:
    router = next(s for s in mesh.services if s.name == "router")
    return metric_value(await scrape(router.metrics_port), "ballast_router_admission_refused_total", tier=tier)


async def wait_b_admission_closed(mesh, refused_before: float, holders: list[asyncio.Task]) -> None:
    """Until the router refuses the next B request: B's one queue place is taken, or a holder
    was already refused. On a slow machine the measured hold time grows, and the router may
    refuse the third holder at once (its estimated wait over B's limit) instead of queueing it:
    either way a B request sent now is refused."""
    deadline = time.monotonic() + 60
    while await router_queued(mesh, "B") < 1 and await router_refused(mesh, "B") <= refused_before:
        assert not all(task.done() for task in holders), [task.result() for task in holders]
        assert time.monotonic() < deadline, "B admission never closed: nothing queued, nothing refused"
        await asyncio.sleep(0.05)


async def test_a_degraded_answer_is_backfilled_and_streamed_to_its_session(mesh, router, http):
    session = f"sse-{uuid.uuid4().hex[:8]}"
    pushed: list[dict] = []

    async def subscribe() -> None:
        async with http.stream("GET", f"/ballast/sessions/{session}/backfill") as reply:
            assert reply.status_code == 200 and reply.headers["Content-Type"] == "text/event-stream"
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    pushed.append(json.loads(line.removeprefix("data: ")))
                    return

    subscription = asyncio.create_task(subscribe())
    refused_before = await router_refused(mesh, "B")
    # Both worker slots and B's one queue place taken: the next B request is refused
    # admission and answered degraded, with a ticket for the better answer.
    holders = [
        asyncio.create_task(
            collect(
                router,
                chat_request(f"{PROMPT} hold {i}", max_tokens=LONG_TOKENS, raw_prompt=True, tier="B"),
                LOCAL_API_KEY,
            )
        )
        for i in range(3)
    ]
    body = {"model": "tiny", "prompt": "Where is order 5512?", "max_tokens": 16, "temperature": 0}
    try:
        await wait_in_flight(mesh, lambda value: value >= 2, timeout=60)
        await wait_b_admission_closed(mesh, refused_before, holders)
        degraded = await http.post(
            "/completions", json=body, headers={"x-ballast-tier": "B", "x-ballast-session-id": session}
        )
    finally:
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    assert degraded.status_code == 200, degraded.text
    ticket = degraded.headers["x-ballast-backfill-ticket"]
    assert degraded.headers["x-ballast-degraded"] != "none"
    assert degraded.json()["ballast"]["backfill_ticket"] == ticket
    # With the pool free again, the backfill replays the request; the subscription gets it.
    await asyncio.wait_for(subscription, 90)
    (answer,) = pushed
    assert answer["ticket"] == ticket and answer["session_id"] == session
    fetched = await http.get(f"/ballast/backfill/{ticket}")
    assert fetched.status_code == 200 and fetched.json() == answer
    # The better answer is the model's own greedy answer to the same request.
    direct = await collect(
        router, chat_request(body["prompt"], max_tokens=16, raw_prompt=True, allow_degraded=False), LOCAL_API_KEY
    )
    assert answer["text"] == direct.text and answer["degraded_level"] != "none"


async def test_requests_are_counted_by_protocol(mesh):
    router = next(s for s in mesh.services if s.name == "router")
    text = await scrape(router.metrics_port)
    assert metric_value(text, "ballast_router_requests_total", protocol="http") > 0
    assert metric_value(text, "ballast_router_requests_total", protocol="grpc") > 0
