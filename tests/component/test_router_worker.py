"""Router and worker as real gRPC servers on port 0 (in process), membership through real etcd."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ballast.v1 import common_pb2, inference_pb2
from services.cli.client import api_key_metadata, chat_request, collect
from services.worker.engine import EngineRequest, Sampling
from tests.component.conftest import API_KEY
from tests.served import assert_served

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "Where is my order? I paid for a blue phone case yesterday."


async def engine_greedy(engine, prompt_ids, max_tokens):
    ids, text = [], ""
    request = EngineRequest("direct", tuple(prompt_ids), (), Sampling(max_tokens=max_tokens, temperature=0.0))
    async for delta in engine.generate(request):
        ids.extend(delta.token_ids)
        text += delta.text
    return ids, text


async def test_greedy_stream_equals_engine_output(router_stub, worker_app, router_app):
    request = chat_request(PROMPT, max_tokens=40, raw_prompt=True)
    result = await collect(router_stub, request, API_KEY)
    expected_ids, expected_text = await engine_greedy(worker_app.engine, worker_app.engine.tokenize(PROMPT), 40)
    assert result.token_ids == expected_ids
    assert result.text == expected_text
    assert result.indices == list(range(len(expected_ids)))
    assert result.started.model_version == worker_app.engine.model.version
    assert result.started.tier == common_pb2.TIER_A and result.started.tier_reason == "default"
    assert result.finished.usage.completion_tokens == len(expected_ids)
    assert result.finished.usage.prompt_tokens == len(worker_app.engine.tokenize(PROMPT))


async def test_chat_messages_use_the_chat_template(router_stub):
    result = await collect(router_stub, chat_request("hello there", max_tokens=8), API_KEY)
    assert_served(result)
    assert result.finished.usage.prompt_tokens > len("hello there".split())


async def test_two_clients_at_once_get_their_own_streams(router_stub):
    a = chat_request(PROMPT, max_tokens=30, raw_prompt=True)
    b = chat_request("Please summarise the refund policy.", max_tokens=30, raw_prompt=True)
    alone_a = await collect(router_stub, a, API_KEY)
    alone_b = await collect(router_stub, b, API_KEY)
    together_a, together_b = await asyncio.gather(collect(router_stub, a, API_KEY), collect(router_stub, b, API_KEY))
    assert together_a.token_ids == alone_a.token_ids
    assert together_b.token_ids == alone_b.token_ids
    assert together_a.token_ids != together_b.token_ids


async def test_seeded_sampling_is_reproducible(router_stub):
    request = chat_request(PROMPT, max_tokens=24, temperature=1.0, seed=7, raw_prompt=True)
    first = await collect(router_stub, request, API_KEY)
    second = await collect(router_stub, request, API_KEY)
    assert first.token_ids == second.token_ids


async def _wait_until(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_client_cancellation_frees_the_worker(router_stub, worker_app):
    request = chat_request(PROMPT, max_tokens=1500, raw_prompt=True)
    call = router_stub.Generate(request, metadata=api_key_metadata(API_KEY))
    seen = 0
    async for event in call:
        if event.HasField("tokens"):
            seen += 1
            if seen == 3:
                break
    assert worker_app.state.in_flight == 1
    call.cancel()
    assert await _wait_until(lambda: worker_app.state.in_flight == 0 and worker_app.engine.stats().running == 0)
    assert worker_app.engine.stats().kv_tokens == 0


async def test_deadline_is_passed_downstream(router_stub, worker_app):
    request = chat_request(PROMPT, max_tokens=1500, raw_prompt=True)
    # The deadline is a quarter of the whole answer's time measured here: it ends the
    # stream midway on a fast machine and on a slow one alike.
    started = time.monotonic()
    whole = await collect(router_stub, request, API_KEY, timeout=60)
    answer_s = time.monotonic() - started
    assert whole.finished.usage.completion_tokens == 1500
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(router_stub, request, API_KEY, timeout=answer_s / 4)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await _wait_until(lambda: worker_app.state.in_flight == 0)


def _bad(**fields):
    # Errors, not degraded answers: these requests do not accept degradation.
    request = chat_request(PROMPT, raw_prompt=True, allow_degraded=False)
    for name, value in fields.items():
        if name == "sampling":
            request.sampling.CopyFrom(value)
        elif name == "conversation":
            request.conversation.CopyFrom(value)
        else:
            setattr(request, name, value)
    return request


@pytest.mark.parametrize(
    "request_, code",
    [
        (_bad(conversation=inference_pb2.Conversation()), grpc.StatusCode.INVALID_ARGUMENT),
        (_bad(sampling=common_pb2.SamplingParams(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT),
        (_bad(sampling=common_pb2.SamplingParams(max_tokens=-1)), grpc.StatusCode.INVALID_ARGUMENT),
        (_bad(sampling=common_pb2.SamplingParams(max_tokens=100000)), grpc.StatusCode.INVALID_ARGUMENT),
        (_bad(tier=9), grpc.StatusCode.INVALID_ARGUMENT),
        (_bad(flush_interval_ms=10_001), grpc.StatusCode.INVALID_ARGUMENT),
        (_bad(prompt="x" * 300_000), grpc.StatusCode.INVALID_ARGUMENT),
        # Fits the character limit but not the model's context window.
        (_bad(prompt="word " * 20_000), grpc.StatusCode.INVALID_ARGUMENT),
        (_bad(model="no-such-model"), grpc.StatusCode.NOT_FOUND),
        (_bad(model="tiny-unserved"), grpc.StatusCode.UNAVAILABLE),
    ],
    ids=[
        "empty-messages",
        "max-tokens-0",
        "max-tokens-negative",
        "max-tokens-over-limit",
        "unknown-tier",
        "flush-interval-over-limit",
        "oversized",
        "over-context",
        "unknown-model",
        "no-live-worker",
    ],
)
async def test_bad_input_gets_its_status_code(router_stub, request_, code, worker_app):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(router_stub, request_, API_KEY)
    assert err.value.code() == code
    assert err.value.details()
    assert worker_app.state.in_flight == 0
    # The service is undisturbed: the next good request streams normally.
    ok = await collect(router_stub, chat_request(PROMPT, max_tokens=4, raw_prompt=True), API_KEY)
    assert_served(ok)


@pytest.mark.parametrize("key", [None, "wrong-key"])
async def test_unauthenticated_calls_are_refused(router_stub, key):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(router_stub, chat_request(PROMPT, raw_prompt=True), key)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_worker_rejects_bad_internal_requests(worker_stub):
    from ballast.v1 import worker_pb2

    cases = [
        worker_pb2.WorkerGenerateRequest(prompt_ids=[], sampling=common_pb2.SamplingParams(max_tokens=4)),
        worker_pb2.WorkerGenerateRequest(prompt_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=0)),
        worker_pb2.WorkerGenerateRequest(prompt_ids=[10**6], sampling=common_pb2.SamplingParams(max_tokens=4)),
    ]
    for request in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in worker_stub.Generate(request, timeout=5):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_worker_continues_from_generated_ids(worker_stub, worker_app):
    from ballast.v1 import worker_pb2

    prompt = worker_app.engine.tokenize(PROMPT)
    full, _ = await engine_greedy(worker_app.engine, prompt, 20)
    request = worker_pb2.WorkerGenerateRequest(
        prompt_ids=prompt,
        generated_ids=full[:8],
        sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0),
    )
    ids, first_indices = [], []
    async for event in worker_stub.Generate(request, timeout=10):
        if event.HasField("tokens"):
            first_indices.append(event.tokens.first_index)
            ids.extend(event.tokens.token_ids)
    assert ids == full[8:]
    assert first_indices[0] == 8


async def test_b_tier_stream_leaves_the_worker_in_chunks(worker_stub, worker_app):
    """B-tier tokens are sent a few per message (worker.b_tier_flush_ms); the same tokens, in
    order, with continuous indices, and the first one alone and at once."""
    from ballast.v1 import worker_pb2

    assert worker_app.config.worker.b_tier_flush_ms > 0
    prompt = worker_app.engine.tokenize(PROMPT)
    full, _ = await engine_greedy(worker_app.engine, prompt, 24)

    async def stream(tier):
        request = worker_pb2.WorkerGenerateRequest(
            prompt_ids=prompt, tier=tier, sampling=common_pb2.SamplingParams(max_tokens=24, temperature=0.0)
        )
        messages = []
        async for event in worker_stub.Generate(request, timeout=20):
            if event.HasField("tokens"):
                messages.append((event.tokens.first_index, list(event.tokens.token_ids)))
        return messages

    chunked = await stream(common_pb2.TIER_B)
    assert [t for _, chunk in chunked for t in chunk] == full
    assert [first for first, _ in chunked] == [sum(len(c) for _, c in chunked[:i]) for i in range(len(chunked))]
    assert len(chunked[0][1]) == 1  # time to first token is not traded away
    assert len(chunked) < len(full) // 2


async def test_a_held_back_answer_comes_in_few_messages_and_ends_on_time(router_stub, worker_app):
    """flush_interval_ms (here at tier A, which has no flush of its own): the first token alone
    and at once, the rest together, the same tokens as a live stream; and the stream ends when
    the answer does, not when the interval runs out."""
    prompt = worker_app.engine.tokenize(PROMPT)
    full, _ = await engine_greedy(worker_app.engine, prompt, 24)
    request = chat_request(PROMPT, max_tokens=24, raw_prompt=True, tier="A")
    request.flush_interval_ms = 2000  # under half of tier A's stall timeout: kept as asked
    messages = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    async for event in router_stub.Generate(request, metadata=api_key_metadata(API_KEY), timeout=20):
        if event.HasField("tokens"):
            messages.append(list(event.tokens.token_ids))
    elapsed = loop.time() - started
    assert [t for chunk in messages for t in chunk] == full
    assert len(messages[0]) == 1
    assert len(messages) <= 3
    assert elapsed < 1.9, f"the stream waited out its flush interval ({elapsed:.2f}s)"


async def test_a_live_stream_comes_in_fewer_messages_than_tokens_by_default(router_stub, worker_app):
    """A request that sets no flush_interval_ms gets the router's stream_interval_ms: the first
    token alone and at once, the later ones several to a message, the same tokens in order."""
    prompt = worker_app.engine.tokenize(PROMPT)
    full, _ = await engine_greedy(worker_app.engine, prompt, 24)
    request = chat_request(PROMPT, max_tokens=24, raw_prompt=True, tier="A")
    messages = []
    async for event in router_stub.Generate(request, metadata=api_key_metadata(API_KEY), timeout=20):
        if event.HasField("tokens"):
            messages.append((event.tokens.first_index, list(event.tokens.token_ids)))
    assert [t for _, chunk in messages for t in chunk] == full
    assert [first for first, _ in messages] == [sum(len(c) for _, c in messages[:i]) for i in range(len(messages))]
    assert len(messages[0][1]) == 1
    assert len(messages) < len(full)


async def test_health_and_reflection(router_app, worker_app):
    for address, service in [(router_app.address, "ballast.v1.Inference"), (worker_app.address, "ballast.v1.Worker")]:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            names = [s.name async for reply in stream for s in reply.list_services_response.service]
            assert service in names and "grpc.health.v1.Health" in names


async def test_metrics_count_requests_by_tier_and_outcome(router_stub, router_app, worker_app):
    await collect(router_stub, chat_request(PROMPT, max_tokens=4, raw_prompt=True, tier="S"), API_KEY)
    text = router_app.telemetry.render()
    assert 'ballast_router_requests_total{outcome="ok",protocol="grpc",tier="S"}' in text
    assert "ballast_router_ttft_milliseconds_bucket" in text
    assert 'ballast_dependency_up{dependency="etcd"} 1.0' in text
    deadline = asyncio.get_running_loop().time() + 30
    while 'context_retention_rate{policy="entity_aware"}' not in router_app.telemetry.render():
        assert asyncio.get_running_loop().time() < deadline, "retention rate never published"
        await asyncio.sleep(0.2)
    worker_text = worker_app.telemetry.render()
    assert "ballast_worker_generated_tokens_total" in worker_text
    assert "ballast_worker_kv_used_ratio" in worker_text


PRODUCT_SCHEMA = (
    '{"type": "object", "properties": {"product_id": {"type": "string"}, "price": {"type": "number"},'
    ' "stock_status": {"type": "string", "enum": ["in_stock", "out_of_stock", "preorder"]}},'
    ' "required": ["product_id", "price", "stock_status"], "additionalProperties": false}'
)


async def test_structured_output_is_validated_and_reported(router_stub):
    import json

    request = chat_request("Give me the product as JSON.", max_tokens=24)
    request.response_format = PRODUCT_SCHEMA
    result = await collect(router_stub, request, API_KEY)
    finished = result.finished
    assert finished.structured_status in (
        common_pb2.STRUCTURED_VALID,
        common_pb2.STRUCTURED_REPAIRED,
        common_pb2.STRUCTURED_FAILED,
    )
    if finished.structured_status != common_pb2.STRUCTURED_FAILED:
        document = json.loads(finished.structured_output)
        assert set(document) == {"product_id", "price", "stock_status"}
    else:
        assert finished.structured_errors


async def test_invalid_schema_is_refused(router_stub):
    request = chat_request("x", max_tokens=4, allow_degraded=False)
    request.response_format = '{"type": "objekt"}'
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(router_stub, request, API_KEY)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "schema" in err.value.details().lower()


async def test_long_conversation_is_fitted_by_policy(router_stub):
    def conversation(policy: str):
        request = chat_request("placeholder", max_tokens=16, allow_degraded=False)
        del request.conversation.messages[:]
        request.conversation.messages.add(role="system", content="You are a shop assistant.")
        request.conversation.messages.add(role="user", content="How much is the blue phone case SKU-77?")
        request.conversation.messages.add(role="assistant", content="The blue phone case SKU-77 costs 39 dollars.")
        for i in range(120):
            request.conversation.messages.add(
                role="user", content=f"Tell me about delivery slot number {i} on the weekend."
            )
            request.conversation.messages.add(role="assistant", content=f"Slot {i} is open on Saturday morning.")
        request.conversation.messages.add(role="user", content="What did you say the phone case SKU-77 costs?")
        request.context.policy = policy
        return request

    kept = await collect(router_stub, conversation("entity_aware"), API_KEY)
    dropped = set(kept.finished.dropped_messages)
    assert dropped and 0 not in dropped and 2 not in dropped  # system prompt and the price turn stay
    oldest = await collect(router_stub, conversation("drop_oldest"), API_KEY)
    assert 2 in set(oldest.finished.dropped_messages)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(router_stub, conversation("error"), API_KEY)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_guided_requests_produce_schema_valid_json(router_stub):
    import json

    import jsonschema

    schema = json.loads(PRODUCT_SCHEMA)
    for seed in range(4):
        request = chat_request("Give me the product as JSON.", max_tokens=96, temperature=1.0, seed=seed)
        request.response_format = PRODUCT_SCHEMA
        result = await collect(router_stub, request, API_KEY)
        assert result.finished.structured_status in (common_pb2.STRUCTURED_VALID, common_pb2.STRUCTURED_REPAIRED)
        jsonschema.validate(json.loads(result.finished.structured_output), schema)
    # Cut short by max_tokens: the router repairs the truncated document.
    request = chat_request("Give me the product as JSON.", max_tokens=6, temperature=1.0, seed=1)
    request.response_format = PRODUCT_SCHEMA
    cut = await collect(router_stub, request, API_KEY)
    assert cut.finished.structured_status == common_pb2.STRUCTURED_REPAIRED
    assert cut.finished.structured_repairs
    jsonschema.validate(json.loads(cut.finished.structured_output), schema)


async def test_resumed_guided_stream_continues_the_grammar(worker_stub, worker_app):
    import json

    import jsonschema

    from ballast.v1 import worker_pb2

    prompt = worker_app.engine.tokenize("<|im_start|>user\nproduct as JSON<|im_end|>\n<|im_start|>assistant\n")

    async def run(generated, max_tokens):
        request = worker_pb2.WorkerGenerateRequest(
            prompt_ids=prompt,
            generated_ids=generated,
            response_format=PRODUCT_SCHEMA,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=11),
        )
        ids, text = [], ""
        async for event in worker_stub.Generate(request, timeout=30):
            if event.HasField("tokens"):
                ids.extend(event.tokens.token_ids)
                text += event.tokens.text
        return ids, text

    full_ids, full_text = await run([], 120)
    head_ids, head_text = await run([], 7)
    tail_ids, tail_text = await run(head_ids, 120 - len(head_ids))
    assert head_ids + tail_ids == full_ids  # the resumed half continues the grammar exactly
    assert head_text + tail_text == full_text
    # The tiny model may run out of tokens inside a string: guided output is always a valid
    # prefix, which the router's repair completes.
    from services.router.structured import Status, check_schema, repair

    result = repair(full_text, check_schema(PRODUCT_SCHEMA))
    assert result.status in (Status.VALID, Status.REPAIRED)
    jsonschema.validate(result.value, json.loads(PRODUCT_SCHEMA))


async def test_chinese_price_turn_survives_entity_aware_truncation(router_stub):
    def conversation(policy: str):
        request = chat_request("placeholder", max_tokens=16, allow_degraded=False)
        del request.conversation.messages[:]
        request.conversation.messages.add(role="system", content="你是一个购物客服助手。")
        request.conversation.messages.add(role="user", content="这款手机壳多少钱？")
        request.conversation.messages.add(role="assistant", content="这款手机壳的价格是 39 元，有黑色和白色。")
        for i in range(60):
            request.conversation.messages.add(role="user", content=f"第 {i} 个快递什么时候到？我住在上海浦东。")
            request.conversation.messages.add(role="assistant", content=f"第 {i} 个快递预计明天下午送达。")
        request.conversation.messages.add(role="user", content="刚才说的手机壳价格是多少")
        request.context.policy = policy
        return request

    kept = await collect(router_stub, conversation("entity_aware"), API_KEY)
    assert kept.finished.dropped_messages and 2 not in kept.finished.dropped_messages
    lost = await collect(router_stub, conversation("drop_oldest"), API_KEY)
    assert 2 in lost.finished.dropped_messages
