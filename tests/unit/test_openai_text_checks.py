"""The HTTP front refuses text no encoder downstream can write, naming where it is."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument
from services.router.openai.errors import InvalidField, NotJson, error_reply
from services.router.openai.mapping import check_headers, parse_json, to_generate_request


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (rb'{"model": "\udfff", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        (rb'{"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
        (
            rb'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00b"}]}]}',
            "messages[0].content[0].text",
        ),
        (rb'{"model": "tiny", "prompt": ["ok", "\ud83d"]}', "prompt[1]"),
        (rb'{"model": "tiny", "metadata": {"\ud800": 1}}', "metadata"),
        (rb'{"model": "tiny", "stop": ["\ude00\ud83d"]}', "stop[0]"),
    ],
)
def test_a_lone_surrogate_anywhere_is_refused_naming_its_field(body, param):
    with pytest.raises(InvalidField) as refused:
        parse_json(body)
    assert refused.value.param == param
    assert "lone surrogate" in refused.value.message
    reply = error_reply(refused.value)
    assert reply.status == 400 and reply.body["error"]["param"] == param
    json.dumps(reply.body).encode()  # the refusal itself is writable


def test_surrogate_pairs_and_escaped_backslashes_are_text():
    body = parse_json(rb'{"model": "tiny", "prompt": "\ud83d\ude00 and \\ud800 literally"}')
    assert body["prompt"] == "\U0001f600 and \\ud800 literally"
    request, _ = to_generate_request(body, {}, chat=False)
    assert request.prompt.startswith("\U0001f600")


@pytest.mark.parametrize("body", [b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "\xff"}', "{}".encode("utf-16")])
def test_a_body_that_is_not_utf8_is_not_json(body):
    with pytest.raises(NotJson) as refused:
        parse_json(body)
    assert "UTF-8" in refused.value.message
    assert error_reply(refused.value).status == 400


@pytest.mark.parametrize(
    "name", ["x-ballast-session-id", "x-ballast-tier", "x-api-key", "authorization", "traceparent"]
)
@pytest.mark.parametrize("value", ["caf\u00e9", "a\udcffb", "bell\x07"])
def test_a_header_ballast_reads_must_be_printable_ascii(name, value):
    with pytest.raises(InvalidArgument) as refused:
        check_headers([("host", "x"), (name, value)])
    assert refused.value.param == name and "printable ASCII" in refused.value.message


def test_other_headers_and_plain_values_pass():
    check_headers([("user-agent", "caf\u00e9/1.0"), ("x-ballast-session-id", "s-1\tok"), ("x-api-key", "k 1")])
