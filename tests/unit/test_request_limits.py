"""router.limits at the edge: messages, message size and JSON Schema bounds refuse a request
with InvalidArgument naming the limit, before anything is queued; the worker's shared checks
(validate_request, the guide compiler) refuse the same schemas before any grammar is built."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from ballast.v1 import inference_pb2
from services.common.errors import InvalidArgument
from services.common.generation import Sampling
from services.common.schema_limits import SchemaLimits
from services.router.requests import OFF_LOOP_BYTES, checked_request, request_from_pb
from services.router.settings import RouterConfig
from services.router.structured import check_schema
from services.router.structured.limits import RequestLimits, check_chat_body
from services.worker.engine import EngineRequest
from services.worker.guided import GuideCompiler
from services.worker.tiny_model import corpus, train_tokenizer
from services.worker.validation import validate_request

BOMB = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 1_000_000_000})
CONFIG = RouterConfig()


def chat(count: int, content: str = "hi") -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest(model="tiny")
    request.conversation.messages.extend(
        inference_pb2.ChatMessage(role="user" if i % 2 == 0 else "assistant", content=content) for i in range(count)
    )
    return request


def refusal(request: inference_pb2.GenerateRequest, config: RouterConfig = CONFIG) -> str:
    with pytest.raises(InvalidArgument) as caught:
        request_from_pb(request, "acme", config)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.message


def test_the_message_count_is_bounded():
    assert request_from_pb(chat(2048), "acme", CONFIG).messages
    message = refusal(chat(2049))
    assert "2049 messages" in message and "router.limits.max_messages" in message


def test_a_hundred_thousand_empty_messages_are_refused_by_count():
    # Under the request's byte limit (the roles alone are 10 bytes a message), over the count.
    config = RouterConfig(max_request_bytes=4 << 20)
    assert "max_messages" in refusal(chat(100_000, ""), config)


def test_each_message_is_bounded():
    config = RouterConfig(limits=RequestLimits(max_message_chars=10))
    request = chat(3)
    request.conversation.messages[2].content = "x" * 11
    message = refusal(request, config)
    assert "conversation.messages[2].content is 11 characters" in message and "max_message_chars" in message


def test_limits_come_from_config():
    config = RouterConfig.model_validate({"limits": {"max_messages": 3, "json_schema": {"max_items": 5}}})
    assert "max_messages" in refusal(chat(4), config)
    request = chat(1)
    request.response_format = json.dumps({"type": "array", "maxItems": 6})
    assert "$.maxItems is 6; the limit is 5" in refusal(request, config)


def test_a_schema_bomb_is_refused_at_the_edge_naming_the_limit_and_path():
    request = chat(1)
    request.response_format = BOMB
    message = refusal(request)
    assert "$.minItems" in message and "max_items" in message


def test_the_schema_text_size_is_bounded():
    request = chat(1)
    request.response_format = json.dumps({"type": "object", "description": "x" * (64 * 1024)})
    assert "max_chars" in refusal(request)


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"maxItems": ' + "9" * 5000 + "}", ["not usable JSON"]),
        ('{"const": ' + "[" * 20_000 + "]" * 20_000 + "}", ["nests deeper"]),
        (json.dumps({"type": "string", "pattern": "^(a+)+$"}), ["$.pattern", "nests quantifiers"]),
        (json.dumps({"type": "string", "format": "ssn"}), ["$.format", "'ssn'"]),
    ],
)
def test_check_schema_refuses_hostile_text_as_invalid_argument(text, words):
    with pytest.raises(InvalidArgument) as caught:
        check_schema(text)
    for word in words:
        assert word in caught.value.message


def test_a_large_valid_schema_passes_every_check():
    props = {f"field_{i}": {"type": "string", "maxLength": 50} for i in range(900)}
    schema = check_schema(json.dumps({"type": "object", "properties": props, "required": list(props)}))
    assert schema.is_valid({f"field_{i}": "x" for i in range(900)})
    assert not schema.is_valid({"field_0": 5})


def test_the_meta_schema_check_still_names_invalid_keywords_in_nested_subschemas():
    with pytest.raises(InvalidArgument) as caught:
        check_schema(json.dumps({"$defs": {"a": {"type": "object", "properties": {"b": {"minLength": "x"}}}}}))
    assert "$.$defs.a.properties.b.minLength" in caught.value.message


def test_a_big_request_is_checked_off_the_loop_with_the_same_outcome():
    big = chat(600, "x" * 200)
    big.request_id = "r1"
    assert big.ByteSize() >= OFF_LOOP_BYTES
    checked = asyncio.run(checked_request(big, "acme", CONFIG))
    assert checked == request_from_pb(big, "acme", CONFIG)
    big.response_format = BOMB
    with pytest.raises(InvalidArgument):
        asyncio.run(checked_request(big, "acme", CONFIG))


@pytest.fixture(scope="module")
def compiler():
    return GuideCompiler(train_tokenizer(corpus(), 512).to_str(), 512, (3, 1))


def engine_request(schema: str) -> EngineRequest:
    return EngineRequest(
        request_id="r", prompt_ids=(5, 6), generated_ids=(), sampling=Sampling(max_tokens=8), response_format=schema
    )


def test_the_worker_refuses_a_bomb_before_compiling(compiler):
    with pytest.raises(InvalidArgument) as caught:
        validate_request(engine_request(BOMB), 512, 1024)
    assert "max_items" in caught.value.message
    with pytest.raises(InvalidArgument) as caught:
        compiler.guide(BOMB)
    assert "max_items" in caught.value.message and "$.minItems" in caught.value.message


def test_the_worker_applies_its_own_limits(compiler):
    schema = json.dumps({"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 20})
    validate_request(engine_request(schema), 512, 1024)
    with pytest.raises(InvalidArgument):
        validate_request(engine_request(schema), 512, 1024, SchemaLimits(max_items=10))
    assert compiler.guide(schema).accepts(compiler_first_token(compiler))


def test_llguidance_limits_refuse_a_grammar_that_slips_past_the_schema_limits():
    tight = GuideCompiler(
        train_tokenizer(corpus(), 512).to_str(),
        512,
        (3, 1),
        limits=SchemaLimits(max_items=100_000, max_total_items=100_000),
    )
    with pytest.raises(InvalidArgument) as caught:
        tight.guide(json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 100_000}))
    assert "guided decoding" in caught.value.message


def compiler_first_token(compiler) -> int:
    tokenizer = train_tokenizer(corpus(), 512)
    return tokenizer.encode("[", add_special_tokens=False).ids[0]


def test_a_big_chat_body_is_refused_by_its_message_count_before_it_is_parsed():
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": ""}] * 3000}).encode()
    with pytest.raises(InvalidArgument) as caught:
        check_chat_body(body, RequestLimits())
    assert "3000 messages" in caught.value.message and "router.limits.max_messages" in caught.value.message
    check_chat_body(json.dumps({"messages": [{"role": "user", "content": "hi"}] * 2048}).encode(), RequestLimits())


@pytest.mark.parametrize(
    "body",
    [b"{", b"[1, 2]", b'{"messages": "x"}', b'{"messages": null}', b"{}", b'{"messages": [{"content": "\\ud800"}]}'],
)
def test_a_chat_body_the_scan_cannot_read_is_left_to_the_full_parse(body):
    check_chat_body(body, RequestLimits())
