"""check_schema: a request's response_format is JSON, a valid JSON Schema and self-contained,
or the request fails with InvalidArgument naming the problem."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from services.common.errors import InvalidArgument
from services.router.structured import check_schema

PRODUCT = {
    "type": "object",
    "properties": {
        "product_id": {"type": "string"},
        "price": {"type": "number"},
        "stock_status": {"enum": ["in_stock", "out_of_stock", "preorder"]},
    },
    "required": ["product_id", "price", "stock_status"],
    "additionalProperties": False,
}


def rejected(text: str) -> str:
    with pytest.raises(InvalidArgument) as caught:
        check_schema(text)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and not caught.value.retriable
    return caught.value.message


def test_a_valid_schema_is_parsed_with_a_2020_12_validator():
    schema = check_schema(json.dumps(PRODUCT))
    assert schema.document == PRODUCT
    assert isinstance(schema.validator, jsonschema.Draft202012Validator)
    assert schema.is_valid({"product_id": "P-1", "price": 3, "stock_status": "preorder"})
    assert not schema.is_valid({"product_id": "P-1", "price": "3"})


def test_the_declared_draft_is_used():
    schema = check_schema(json.dumps({"$schema": "http://json-schema.org/draft-07/schema#", **PRODUCT}))
    assert isinstance(schema.validator, jsonschema.Draft7Validator)


@pytest.mark.parametrize(
    "text, words",
    [
        ("", ["empty"]),
        ("{not json", ["not valid JSON", "line 1"]),
        ('["type", "object"]', ["JSON Schema object"]),
        ('{"type": "strin"}', ["'strin'", "$.type", "not a JSON type"]),
        ('{"type": "object", "properties": {"price": {"type": 5}}}', ["$.properties.price.type"]),
        ('{"type": "object", "required": "price"}', ["not a valid JSON Schema", "$.required"]),
        ('{"type": "string", "minLength": -1}', ["$.minLength"]),
        ('{"$schema": "https://example.com/my-dialect", "type": "object"}', ["unknown $schema"]),
        ('{"properties": {"a": {"$ref": "https://example.com/a.json"}}}', ["not local", "$.properties.a"]),
        ('{"properties": {"a": {"$ref": "#/$defs/missing"}}}', ["cannot be resolved"]),
    ],
)
def test_an_invalid_schema_names_the_problem(text, words):
    message = rejected(text)
    for word in words:
        assert word in message, message


def test_local_refs_and_data_that_looks_like_a_ref_are_fine():
    schema = check_schema(
        json.dumps(
            {
                "$defs": {"price": {"type": "number", "minimum": 0}},
                "type": "object",
                "properties": {"price": {"$ref": "#/$defs/price"}, "meta": {"const": {"$ref": "http://x"}}},
            }
        )
    )
    assert schema.is_valid({"price": 1}) and not schema.is_valid({"price": -1})
