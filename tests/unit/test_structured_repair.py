"""repair() on a corpus of broken model outputs: truncated, missing fields, wrong types, extra
fields, prose around the JSON, nested objects and arrays; and what must stay FAILED."""

from __future__ import annotations

import json

import pytest

from services.router.structured import RepairKind, Status, check_schema, placeholder_answer, repair

PRODUCT = check_schema(
    json.dumps(
        {
            "type": "object",
            "properties": {
                "product_id": {"type": "string"},
                "price": {"type": "number"},
                "stock_status": {"enum": ["in_stock", "out_of_stock", "preorder"]},
                "on_sale": {"type": "boolean", "default": False},
                "quantity": {"type": "integer"},
            },
            "required": ["product_id", "price", "stock_status"],
            "additionalProperties": False,
        }
    )
)

ORDER = check_schema(
    json.dumps(
        {
            "$defs": {
                "line": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "default": 1}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {
                "order_id": {"type": "integer"},
                "customer": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                    "required": ["name", "vip"],
                    "additionalProperties": False,
                },
                "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "maxItems": 2},
                "kind": {"const": "order"},
                "note": {"type": ["string", "null"]},
            },
            "required": ["order_id", "customer", "lines", "kind"],
        }
    )
)

GOOD = {"product_id": "P-1", "price": 39, "stock_status": "in_stock"}

# (name, schema, output, status, value, repair kinds in order)
CORPUS = [
    ("valid", PRODUCT, json.dumps(GOOD), Status.VALID, GOOD, []),
    ("valid with whitespace", PRODUCT, "\n  " + json.dumps(GOOD, indent=2) + "\n", Status.VALID, GOOD, []),
    (
        "truncated in a string",
        PRODUCT,
        '{"price": 39, "stock_status": "preorder", "product_id": "P-',
        Status.REPAIRED,
        {"product_id": "P-", "price": 39, "stock_status": "preorder"},
        [RepairKind.TRUNCATED],
    ),
    (
        "truncated in an enum value",
        PRODUCT,
        '{"product_id": "P-1", "price": 39, "stock_status": "out_of',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 39, "stock_status": "out_of_stock"},
        [RepairKind.TRUNCATED, RepairKind.TRUNCATED],
    ),
    (
        "cut before an enum value",
        PRODUCT,
        '{"product_id": "P-1", "price": 39, "stock_status": "',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 39, "stock_status": "in_stock"},
        [RepairKind.TRUNCATED, RepairKind.FILLED],
    ),
    (
        "cut after a key",
        PRODUCT,
        '{"product_id": "P-1", "price": 39, "stock_status": "preorder", "on_sale":',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 39, "stock_status": "preorder", "on_sale": False},
        [RepairKind.TRUNCATED, RepairKind.FILLED],
    ),
    (
        "truncated after a value",
        PRODUCT,
        '{"product_id": "P-1", "price": 39',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 39, "stock_status": "in_stock"},
        [RepairKind.TRUNCATED, RepairKind.FILLED],
    ),
    (
        "truncated inside a key",
        PRODUCT,
        '{"product_id": "P-1", "pri',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 0, "stock_status": "in_stock"},
        [RepairKind.TRUNCATED, RepairKind.FILLED, RepairKind.FILLED],
    ),
    (
        "truncated in a literal",
        PRODUCT,
        '{"product_id": "P-1", "price": 5, "stock_status": "preorder", "on_sale": fa',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 5, "stock_status": "preorder", "on_sale": False},
        [RepairKind.TRUNCATED, RepairKind.TRUNCATED],
    ),
    (
        "truncated in an exponent",
        PRODUCT,
        '{"product_id": "P-1", "stock_status": "preorder", "price": -2.5e-',
        Status.REPAIRED,
        {"product_id": "P-1", "price": -2.5, "stock_status": "preorder"},
        [RepairKind.TRUNCATED, RepairKind.TRUNCATED],
    ),
    (
        "truncated after a minus sign",
        PRODUCT,
        '{"product_id": "P-1", "stock_status": "preorder", "price": -',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 0, "stock_status": "preorder"},
        [RepairKind.TRUNCATED, RepairKind.FILLED],
    ),
    (
        "only an opening brace",
        PRODUCT,
        "{",
        Status.REPAIRED,
        {"product_id": "", "price": 0, "stock_status": "in_stock"},
        [RepairKind.TRUNCATED, RepairKind.FILLED, RepairKind.FILLED, RepairKind.FILLED],
    ),
    (
        "missing fields",
        PRODUCT,
        '{"product_id": "P-1"}',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 0, "stock_status": "in_stock"},
        [RepairKind.FILLED, RepairKind.FILLED],
    ),
    (
        "numbers as strings",
        PRODUCT,
        '{"product_id": "P-1", "price": "39.90", "stock_status": "in_stock", "quantity": "3"}',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 39.9, "stock_status": "in_stock", "quantity": 3},
        [RepairKind.COERCED, RepairKind.COERCED],
    ),
    (
        "id as a number, whole float as integer",
        PRODUCT,
        '{"product_id": 1234, "price": 5, "stock_status": "in_stock", "quantity": 2.0}',
        Status.REPAIRED,
        {"product_id": "1234", "price": 5, "stock_status": "in_stock", "quantity": 2},
        [RepairKind.COERCED],
    ),
    (
        "boolean as a string, enum spelled loosely",
        PRODUCT,
        '{"product_id": "P-1", "price": 5, "stock_status": "Out of stock", "on_sale": "TRUE"}',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 5, "stock_status": "out_of_stock", "on_sale": True},
        [RepairKind.COERCED, RepairKind.COERCED],
    ),
    (
        "extra fields",
        PRODUCT,
        '{"product_id": "P-1", "price": 5, "stock_status": "preorder", "color": "red", "size": 4}',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 5, "stock_status": "preorder"},
        [RepairKind.DROPPED, RepairKind.DROPPED],
    ),
    (
        "prose around a fenced block",
        PRODUCT,
        "Sure! Here is the product:\n```json\n" + json.dumps(GOOD) + "\n```\nAnything else?",
        Status.REPAIRED,
        GOOD,
        [RepairKind.EXTRACTED],
    ),
    (
        "prose before truncated JSON",
        PRODUCT,
        'The answer is {"product_id": "P-1", "price": 39, ',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 39, "stock_status": "in_stock"},
        [RepairKind.EXTRACTED, RepairKind.TRUNCATED, RepairKind.FILLED],
    ),
    (
        "single quotes and a trailing comma",
        PRODUCT,
        "{'product_id': 'P-1', 'price': 39, 'stock_status': 'in_stock',}",
        Status.REPAIRED,
        GOOD,
        [RepairKind.SYNTAX],
    ),
    (
        "a trailing comma, then prose",
        PRODUCT,
        '{"product_id": "P-1", "price": 39, "stock_status": "in_stock",} hope this helps',
        Status.REPAIRED,
        GOOD,
        [RepairKind.SYNTAX],
    ),
    (
        "two documents",
        PRODUCT,
        json.dumps(GOOD) + json.dumps({**GOOD, "price": 1}),
        Status.REPAIRED,
        GOOD,
        [RepairKind.EXTRACTED],
    ),
    (
        "null for a required number",
        PRODUCT,
        '{"product_id": "P-1", "price": null, "stock_status": "in_stock"}',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 0, "stock_status": "in_stock"},
        [RepairKind.FILLED],
    ),
    (
        "NaN",
        PRODUCT,
        '{"product_id": "P-1", "price": NaN, "stock_status": "in_stock"}',
        Status.REPAIRED,
        {"product_id": "P-1", "price": 0, "stock_status": "in_stock"},
        [RepairKind.SYNTAX, RepairKind.FILLED],
    ),
    (
        "nested: missing, wrong types, extras, too many items",
        ORDER,
        '{"order_id": "77", "customer": {"name": "Li", "vip": "false", "age": 3},'
        ' "lines": [{"sku": "A1", "qty": "2"}, {"sku": "B2"}, {"sku": "C3", "qty": 1}], "note": null}',
        Status.REPAIRED,
        {
            "order_id": 77,
            "customer": {"name": "Li", "vip": False},
            "lines": [{"sku": "A1", "qty": 2}, {"sku": "B2", "qty": 1}],
            "note": None,
            "kind": "order",
        },
        [
            RepairKind.COERCED,
            RepairKind.COERCED,
            RepairKind.DROPPED,
            RepairKind.COERCED,
            RepairKind.FILLED,
            RepairKind.DROPPED,
            RepairKind.FILLED,
        ],
    ),
    (
        "nested object missing entirely",
        ORDER,
        '{"order_id": 1, "lines": [], "kind": "order"}',
        Status.REPAIRED,
        {"order_id": 1, "lines": [], "kind": "order", "customer": {"name": "", "vip": False}},
        [RepairKind.FILLED],
    ),
    (
        "object sent as a JSON string",
        ORDER,
        '{"order_id": 1, "lines": [], "kind": "order", "customer": "{\\"name\\": \\"Li\\", \\"vip\\": true}"}',
        Status.REPAIRED,
        {"order_id": 1, "lines": [], "kind": "order", "customer": {"name": "Li", "vip": True}},
        [RepairKind.COERCED],
    ),
    (
        "a single item where a list belongs",
        ORDER,
        '{"order_id": 1, "customer": {"name": "Li", "vip": true}, "kind": "order", "lines": {"sku": "A1", "qty": 1}}',
        Status.REPAIRED,
        {"order_id": 1, "customer": {"name": "Li", "vip": True}, "kind": "order", "lines": [{"sku": "A1", "qty": 1}]},
        [RepairKind.COERCED],
    ),
    # What must not be "fixed": inventing an enum member or reading words as numbers.
    (
        "unknown enum member",
        PRODUCT,
        '{"product_id": "P-1", "price": 5, "stock_status": "sold"}',
        Status.FAILED,
        None,
        [],
    ),
    (
        "a number in words",
        PRODUCT,
        '{"product_id": "P-1", "price": "thirty-nine", "stock_status": "in_stock"}',
        Status.FAILED,
        None,
        [],
    ),
    ("prose only", PRODUCT, "The phone case costs 39 yuan and is in stock.", Status.FAILED, None, []),
    ("empty", PRODUCT, "   ", Status.FAILED, None, []),
    ("an array where an object belongs", PRODUCT, "[1, 2, 3]", Status.FAILED, None, []),
]


@pytest.mark.parametrize("name, schema, output, status, value, kinds", CORPUS, ids=[c[0] for c in CORPUS])
def test_corpus(name, schema, output, status, value, kinds):
    result = repair(output, schema)
    assert result.status is status, (result.messages, result.errors)
    assert [r.kind for r in result.repairs] == kinds, result.messages
    if status is Status.FAILED:
        assert result.errors and result.text == output
        return
    assert result.value == value
    assert json.loads(result.text) == value and schema.is_valid(json.loads(result.text))
    if status is Status.VALID:
        assert result.text == output.strip() and not result.repairs


def test_repairs_read_as_sentences():
    result = repair('{"product_id": 7, "color": "red"}', PRODUCT)
    assert result.messages == [
        "converted 'product_id' from 7 to \"7\"",
        "dropped 'color' (not allowed by the schema)",
        "filled missing 'price' with 0",
        "filled missing 'stock_status' with \"in_stock\"",
    ]
    nested = repair(
        '{"order_id": 1, "customer": {"name": "Li", "vip": true}, "kind": "order", "lines": [{"sku": "A1"}]}', ORDER
    )
    assert nested.messages == ["filled missing 'lines[0].qty' with 1"]


def test_defaults_then_const_then_first_enum_then_zero_values():
    schema = check_schema(
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "default": 5},
                    "b": {"const": "fixed"},
                    "c": {"enum": [3, 4]},
                    "d": {"type": "string"},
                    "e": {"type": "boolean"},
                    "f": {"type": "array"},
                    "g": {"type": ["null", "string"]},
                    "h": {"anyOf": [{"type": "number"}, {"type": "string"}]},
                },
                "required": list("abcdefgh"),
            }
        )
    )
    result = repair("{}", schema)
    assert result.status is Status.REPAIRED
    assert result.value == {"a": 5, "b": "fixed", "c": 3, "d": "", "e": False, "f": [], "g": None, "h": 0}


def test_a_filled_number_respects_the_bounds():
    schema = check_schema(
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "qty": {"type": "integer", "minimum": 1},
                    "discount": {"type": "number", "maximum": -0.5},
                    "rank": {"type": "integer", "exclusiveMinimum": 0},
                    "score": {"type": "number"},
                },
                "required": ["qty", "discount", "rank", "score"],
            }
        )
    )
    assert repair("{}", schema).value == {"qty": 1, "discount": -0.5, "rank": 1, "score": 0}


def test_a_cut_off_last_array_item_is_dropped_not_invented():
    cut = (
        '{"order_id": 1, "customer": {"name": "Li", "vip": true}, "kind": "order", '
        '"lines": [{"sku": "A1", "qty": 2}, {"sku": "B'
    )
    result = repair(cut, ORDER)
    assert result.status is Status.REPAIRED
    assert result.value["lines"] == [{"sku": "A1", "qty": 2}]
    assert "dropped the cut-off last item of 'lines'" in result.messages
    for tail in ('"sk', '"sku"', '"sku" '):  # cut in a key, or after it before its colon
        in_key = repair(cut[: cut.rindex('"sku": "B')] + tail, ORDER)
        assert in_key.status is Status.REPAIRED and in_key.value["lines"] == [{"sku": "A1", "qty": 2}], tail
    nested = repair('{"order_id": 1, "kind": "order", "lines": [], "customer": {"name": "Li", "v', ORDER)
    assert nested.status is Status.REPAIRED and nested.value["customer"] == {"name": "Li", "vip": False}
    # A complete output keeps an incomplete item and fills it instead: the model meant it.
    whole = repair(cut + '"}]}', ORDER)
    assert whole.value["lines"] == [{"sku": "A1", "qty": 2}, {"sku": "B", "qty": 1}]


def test_any_of_takes_the_branch_a_repair_satisfies():
    schema = check_schema(
        json.dumps(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}},
                        "required": ["kind", "n"],
                    },
                    {"type": "integer"},
                ]
            }
        )
    )
    assert repair("12", schema).status is Status.VALID
    fixed = repair('{"kind": "a", "n": "4"}', schema)
    assert fixed.status is Status.REPAIRED and fixed.value == {"kind": "a", "n": 4}


def test_a_self_referencing_schema_terminates():
    schema = check_schema(
        json.dumps(
            {
                "$defs": {
                    "node": {
                        "type": "object",
                        "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
                        "required": ["v"],
                    }
                },
                "$ref": "#/$defs/node",
            }
        )
    )
    result = repair('{"v": "1", "next": {"v": 2, "next": {"next": {"v": "3"}}}}', schema)
    assert result.status is Status.REPAIRED
    assert result.value == {"v": 1, "next": {"v": 2, "next": {"v": 0, "next": {"v": 3}}}}


def test_unicode_survives_repair():
    result = repair('{"product_id": "手机壳-39", "price": "39", "stock_status": "in_stock"', PRODUCT)
    assert result.status is Status.REPAIRED
    assert "手机壳-39" in result.text and result.value["price"] == 39


def test_an_answer_without_a_model_is_the_schemas_placeholder_and_says_so():
    result = placeholder_answer(PRODUCT)
    assert result.status is Status.REPAIRED
    assert [r.kind for r in result.repairs] == [RepairKind.FILLED]
    # Every required field, each its default, first enum value or zero; nothing optional.
    assert json.loads(result.text) == {"product_id": "", "price": 0, "stock_status": "in_stock"}
    assert PRODUCT.is_valid(result.value)
    nested = placeholder_answer(ORDER)
    assert nested.status is Status.REPAIRED and ORDER.is_valid(nested.value)


def test_a_schema_no_placeholder_satisfies_is_failed_not_passed_off():
    impossible = check_schema(json.dumps({"type": "string", "minLength": 3}))
    result = placeholder_answer(impossible)
    assert result.status is Status.FAILED and result.errors
