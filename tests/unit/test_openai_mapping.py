"""The OpenAI-compatible front's pure parts: request mapping, error shapes, answer shapes."""

from __future__ import annotations

import json

import pytest

from ballast.v1 import common_pb2, inference_pb2
from services.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NoLiveWorker,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from services.router.openai.errors import BodyTooLarge, InvalidField, NotJson, UnsupportedField, error_reply
from services.router.openai.mapping import parse_json, to_generate_request
from services.router.openai.responses import Answer, degraded_headers

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields):
    return {**CHAT, **fields}


def test_chat_body_maps_to_generate_request():
    body = chat(
        max_completion_tokens=7,
        temperature=0,
        top_p=0.5,
        seed=3,
        stop="\n",
        stream=True,
        stream_options={"include_usage": True},
        user="u1",
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
    )
    request, shape = to_generate_request(body, {"x-ballast-session-id": "s1"}, chat=True)
    assert [(m.role, m.content) for m in request.conversation.messages] == [("system", "be brief"), ("user", "ab")]
    assert request.sampling.max_tokens == 7 and request.sampling.temperature == 0
    assert request.sampling.HasField("temperature") and request.sampling.seed == 3
    assert list(request.sampling.stop) == ["\n"] and request.session_id == "s1"
    assert request.tier == common_pb2.TIER_AUTO and not request.HasField("allow_degraded")
    assert shape.chat and shape.stream and shape.include_usage and shape.model == "tiny"


def test_completions_prompt_and_max_tokens():
    request, shape = to_generate_request({"model": "tiny", "prompt": ["once"], "max_tokens": 4}, {}, chat=False)
    assert request.WhichOneof("input") == "prompt" and request.prompt == "once"
    assert request.sampling.max_tokens == 4 and not shape.chat and not shape.include_usage


@pytest.mark.parametrize(
    ("body", "headers", "tier"),
    [
        (chat(service_tier="priority"), {}, common_pb2.TIER_S),
        (chat(service_tier="flex"), {}, common_pb2.TIER_B),
        (chat(service_tier="default"), {}, common_pb2.TIER_AUTO),
        (chat(service_tier="auto"), {}, common_pb2.TIER_AUTO),
        (chat(service_tier="flex"), {"x-ballast-tier": "a"}, common_pb2.TIER_A),
    ],
)
def test_tiers(body, headers, tier):
    assert to_generate_request(body, headers, chat=True)[0].tier == tier


def test_response_formats_become_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request, _ = to_generate_request(
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}),
        {},
        chat=True,
    )
    assert json.loads(request.response_format) == schema
    request, _ = to_generate_request(chat(response_format={"type": "json_object"}), {}, chat=True)
    assert json.loads(request.response_format) == {"type": "object"}
    request, _ = to_generate_request(chat(response_format={"type": "text"}), {}, chat=True)
    assert request.response_format == ""


def test_allow_degraded_header():
    request, _ = to_generate_request(chat(), {"x-ballast-allow-degraded": "false"}, chat=True)
    assert request.HasField("allow_degraded") and not request.allow_degraded


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 2),
        ("tools", [{"type": "function"}]),
        ("tool_choice", "auto"),
        ("logprobs", True),
        ("functions", [{"name": "f"}]),
        ("presence_penalty", 0.5),
    ],
)
def test_unsupported_fields_are_refused_by_name(field, value):
    with pytest.raises(UnsupportedField) as caught:
        to_generate_request(chat(**{field: value}), {}, chat=True)
    assert caught.value.param == field
    reply = error_reply(caught.value)
    assert reply.status == 400 and reply.body["error"]["param"] == field


@pytest.mark.parametrize("field,value", [("n", 1), ("logprobs", False), ("tools", None), ("presence_penalty", 0)])
def test_neutral_values_of_unsupported_fields_pass(field, value):
    to_generate_request(chat(**{field: value}), {}, chat=True)


@pytest.mark.parametrize(
    "body,param",
    [
        ([], "body"),
        (chat(model=3), "model"),
        (chat(messages="hi"), "messages"),
        (chat(messages=[]), "messages"),
        (chat(max_tokens="5"), "max_tokens"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(max_tokens=1 << 40), "max_tokens"),
        (chat(temperature="hot"), "temperature"),
        (chat(stop=[1]), "stop"),
        (chat(stream="yes"), "stream"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(service_tier="gold"), "service_tier"),
        (chat(seed=-1), "seed"),
        (chat(response_format={"type": "xml"}), "response_format.type"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content"),
    ],
)
def test_wrong_types_name_the_field(body, param):
    with pytest.raises(InvalidField) as caught:
        to_generate_request(body, {}, chat=True)
    assert caught.value.param == param


def test_json_depth_and_syntax():
    assert parse_json(b'{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    with pytest.raises(NotJson):
        parse_json(b"{not json")
    with pytest.raises(NotJson):
        parse_json(b"[" * 65 + b"]" * 65)
    with pytest.raises(NotJson):
        parse_json(b"[" * 100_000 + b"]" * 100_000)


@pytest.mark.parametrize(
    "error,status,headers",
    [
        (InvalidArgument("x"), 400, {}),
        (Unauthenticated("x"), 401, {}),
        (NotFound("x"), 404, {}),
        (ResourceExhausted("x", retry_after_s=2.2), 429, {"Retry-After": "3"}),
        (ResourceExhausted("x", retry_after_s=0.05), 429, {"Retry-After": "1"}),
        (NoLiveWorker("x"), 503, {"Retry-After": "1"}),
        (DeadlineExceeded("x"), 504, {}),
        (BodyTooLarge("x"), 413, {}),
        (NotJson("x"), 400, {}),
        (RuntimeError("x"), 500, {}),
    ],
)
def test_error_replies(error, status, headers):
    reply = error_reply(error)
    assert reply.status == status and reply.headers == headers
    assert set(reply.body["error"]) == {"message", "type", "param", "code"}


def test_overload_code_is_its_fault():
    assert error_reply(ResourceExhausted("full")).body["error"]["code"] == "overloaded"
    assert error_reply(NoLiveWorker("none")).body["error"]["code"] == "no_live_worker"


def _events(degraded: bool = False):
    yield inference_pb2.GenerateEvent(started=inference_pb2.Started(request_id="r1", model="tiny", model_version="v"))
    yield inference_pb2.GenerateEvent(tokens=common_pb2.Tokens(text="Hel", token_ids=[1], first_index=0))
    yield inference_pb2.GenerateEvent(tokens=common_pb2.Tokens(text="lo", token_ids=[2], first_index=1))
    finished = inference_pb2.Finished(
        reason=common_pb2.FINISH_REASON_LENGTH, usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=2), resumes=1
    )
    if degraded:
        finished.degradation = common_pb2.DEGRADATION_RULES
        finished.backfill_ticket = "t-1"
    yield inference_pb2.GenerateEvent(finished=finished)


def test_whole_answer_shape():
    _, shape = to_generate_request(chat(), {}, chat=True)
    answer = Answer(shape)
    for event in _events():
        answer.feed(event)
    body = answer.response()
    assert body["id"] == "chatcmpl-r1" and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert body["ballast"]["degradation"] == "none" and body["ballast"]["resumes"] == 1
    assert degraded_headers(answer.finished) == {}


def test_degraded_answer_headers_and_extras():
    _, shape = to_generate_request(chat(), {}, chat=True)
    answer = Answer(shape)
    for event in _events(degraded=True):
        answer.feed(event)
    assert degraded_headers(answer.finished) == {"x-ballast-degraded": "rules", "x-ballast-backfill-ticket": "t-1"}
    assert answer.response()["ballast"]["backfill_ticket"] == "t-1"


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chunks(include_usage):
    body = chat(stream=True, stream_options={"include_usage": include_usage})
    _, shape = to_generate_request(body, {}, chat=True)
    answer = Answer(shape)
    texts = [t for t in (answer.feed(e) for e in _events()) if t]
    assert [answer.text_chunk(t)["choices"][0]["delta"]["content"] for t in texts] == ["Hel", "lo"]
    assert answer.first_chunk()["choices"][0]["delta"]["role"] == "assistant"
    final = answer.final_chunks()
    assert final[0]["choices"][0]["finish_reason"] == "length" and "ballast" in final[0]
    assert len(final) == (2 if include_usage else 1)
    if include_usage:
        assert final[1]["choices"] == [] and final[1]["usage"]["total_tokens"] == 7
