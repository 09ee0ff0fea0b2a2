"""check_schema_limits and pattern_problem: every bounded keyword, combinations, $ref chains,
catastrophic regexes, huge enums and deep nesting are refused naming the limit and the JSON
path; schemas a real client sends pass."""

from __future__ import annotations

import json

import grpc
import pytest

from services.common.errors import InvalidArgument
from services.common.schema_limits import (
    SchemaLimits,
    check_schema_limits,
    iter_subschemas,
    parse_schema,
    pattern_problem,
)

LIMITS = SchemaLimits()

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "placed": {"type": "string", "format": "date-time"},
        "lines": {"type": "array", "maxItems": 200, "items": {"$ref": "#/$defs/line"}},
        "status": {"enum": ["open", "paid", "shipped"]},
        "note": {"type": "string", "maxLength": 2000},
        "contact": {"anyOf": [{"type": "string", "format": "email"}, {"type": "null"}]},
    },
    "required": ["id", "lines"],
    "$defs": {
        "line": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d+$"},
                "qty": {"type": "integer", "minimum": 1},
            },
        }
    },
}


def refused(schema, limits: SchemaLimits = LIMITS) -> str:
    with pytest.raises(InvalidArgument) as caught:
        check_schema_limits(schema, limits)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and not caught.value.retriable
    return caught.value.message


def test_a_real_schema_passes():
    check_schema_limits(ORDER, LIMITS)


@pytest.mark.parametrize(
    "keyword, limit",
    [
        ("minItems", "max_items"),
        ("maxItems", "max_items"),
        ("minContains", "max_items"),
        ("maxContains", "max_items"),
        ("minLength", "max_length"),
        ("maxLength", "max_length"),
        ("minProperties", "max_properties"),
        ("maxProperties", "max_properties"),
    ],
)
def test_each_count_keyword_is_bounded_and_named_with_its_path(keyword, limit):
    bound = getattr(LIMITS, limit)
    inner = {"type": "object", "properties": {"x": {keyword: bound}}}
    check_schema_limits(inner, LIMITS)
    message = refused({"type": "object", "properties": {"x": {keyword: 10**9}}})
    assert f"$.properties.x.{keyword}" in message and limit in message and "1000000000" in message


def test_a_float_count_is_bounded_like_an_integer():
    assert "max_items" in refused({"type": "array", "minItems": 1e9})


def test_the_billion_item_array_is_refused():
    assert "max_items" in refused({"type": "array", "items": {"type": "integer"}, "minItems": 1_000_000_000})


def test_item_counts_add_up_across_the_schema():
    limits = SchemaLimits(max_items=100, max_total_items=250)
    three = {"type": "object", "properties": {f"a{i}": {"type": "array", "maxItems": 100} for i in range(3)}}
    message = refused(three, limits)
    assert "max_total_items" in message and "$.properties.a2" in message
    check_schema_limits(
        {"type": "object", "properties": {f"a{i}": {"type": "array", "maxItems": 100} for i in range(2)}}, limits
    )


def test_prefix_items_are_counted():
    assert "$.prefixItems" in refused({"prefixItems": [{}] * 1001})


def test_a_huge_enum_is_refused():
    message = refused({"type": "object", "properties": {"c": {"enum": list(range(5000))}}})
    assert "$.properties.c.enum" in message and "5000 values" in message and "max_enum" in message


@pytest.mark.parametrize("keyword", ["anyOf", "oneOf", "allOf"])
def test_wide_branches_are_refused(keyword):
    message = refused({keyword: [{"type": "integer"}] * 500})
    assert f"$.{keyword}" in message and "max_branches" in message


def test_many_properties_are_refused():
    message = refused({"type": "object", "properties": {f"p{i}": {} for i in range(1500)}})
    assert "$.properties" in message and "max_properties" in message


def test_deep_nesting_is_refused_by_subschema_depth():
    schema: dict = {"type": "integer"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    message = refused(schema, SchemaLimits(max_json_depth=1000))
    assert "max_depth" in message and "$.items.items" in message


def test_deep_json_inside_a_value_is_refused():
    value: list = []
    for _ in range(100):
        value = [value]
    assert "max_json_depth" in refused({"const": value})


def test_a_ref_chain_that_doubles_per_link_is_refused_by_the_expanded_count():
    defs = {"a0": {"type": "integer"}}
    for i in range(1, 40):
        defs[f"a{i}"] = {"anyOf": [{"$ref": f"#/$defs/a{i - 1}"}] * 2}
    schema = {"$defs": defs, "$ref": "#/$defs/a39"}
    message = refused(schema, SchemaLimits(max_depth=1000, max_json_depth=1000))
    assert "max_subschemas" in message


def test_a_ref_chain_through_anchors_is_counted_too():
    defs = {"a0": {"$anchor": "a0", "type": "integer"}}
    for i in range(1, 4):
        defs[f"a{i}"] = {"$anchor": f"a{i}", "anyOf": [{"$ref": f"#a{i - 1}"}] * 64}
    assert "max_subschemas" in refused({"$defs": defs, "$ref": "#a3"})


def test_unreferenced_definitions_are_bounded_too():
    assert "$.$defs.unused.minItems" in refused({"$defs": {"unused": {"minItems": 10**9}}, "type": "string"})


def test_a_wide_ref_chain_is_refused_before_its_depth():
    defs = {
        "a0": {"type": "integer"},
        "a1": {"anyOf": [{"$ref": "#/$defs/a0"}] * 100},
        "a2": {"anyOf": [{"$ref": "#/$defs/a1"}] * 100},
    }
    assert "max_subschemas" in refused({"$defs": defs, "$ref": "#/$defs/a2"})


def test_a_definition_used_many_times_is_counted_at_each_use():
    item = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(50)}}
    uses = {
        "type": "object",
        "properties": {f"p{i}": {"$ref": "#/$defs/item"} for i in range(100)},
        "$defs": {"item": item},
    }
    assert "max_subschemas" in refused(uses)
    check_schema_limits(uses, SchemaLimits(max_subschemas=10_000))


def test_recursion_through_the_value_is_allowed_but_in_place_recursion_is_not():
    tree = {
        "$defs": {
            "node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
        },
        "$ref": "#/$defs/node",
    }
    check_schema_limits(tree, LIMITS)
    loop = {
        "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
        "$ref": "#/$defs/a",
    }
    assert "infinite recursion" in refused(loop)
    assert "infinite recursion" in refused({"allOf": [{"$ref": "#"}]})


def test_unknown_formats_are_refused_and_known_ones_pass():
    check_schema_limits({"type": "string", "format": "uuid"}, LIMITS)
    message = refused({"type": "object", "properties": {"x": {"type": "string", "format": "credit-card"}}})
    assert "'credit-card'" in message and "$.properties.x.format" in message and "formats" in message


def test_patterns_are_checked_everywhere_they_appear():
    assert "$.properties.k.pattern" in refused({"properties": {"k": {"type": "string", "pattern": "(a+)+"}}})
    assert "$.patternProperties[0]" in refused({"patternProperties": {"^(x*)*$": {}}})
    assert "$.propertyNames.pattern" in refused({"propertyNames": {"pattern": "(?=a)"}})


@pytest.mark.parametrize(
    "pattern",
    [
        "^[a-z]+$",
        "^ORD-[0-9]{6}$",
        "^(\\+|-)?[0-9]+$",
        "^(foo|bar)*$",
        "^[A-Z]{2}\\d{2}( ?\\d{4}){4}$",
        "^\\d{3}-\\d{4}$",
        "^(?:[a-z0-9]+\\.)?example\\.com$",
        "^[^@]+@[^@]+$",
        "^\\p{L}+$",
        "a{2,}",
        "{",
        "x{a}",
        "^(a+)?$",
        "^[(]+$",
        "^(\\d{4})+$",
        "^(a{2}b{3})*$",
        "^(-?\\d+){3}$",
    ],
)
def test_ordinary_patterns_pass(pattern):
    assert pattern_problem(pattern, LIMITS) is None, pattern


@pytest.mark.parametrize(
    "pattern, words",
    [
        ("^(a+)+$", ["nests quantifiers"]),
        ("(a*)*", ["nests quantifiers"]),
        ("(a?){30}a{30}", ["nests quantifiers"]),
        ("((a?){3}){30}", ["nests quantifiers"]),
        ("((ab)+c)+", ["nests quantifiers"]),
        ("^(a|aa)+$", ["alternatives"]),
        ("^(\\w|\\d)*$", ["alternatives"]),
        ("^([a-z]|[0-9])+$", ["alternatives"]),
        ("(a)\\1", ["backreference"]),
        ("(?<x>a)\\k<x>", ["backreference"]),
        ("(?P<x>a)(?P=x)", ["backreference"]),
        ("(?=a)b", ["lookaround"]),
        ("a(?!b)", ["lookaround"]),
        ("(?<=a)b", ["lookaround"]),
        ("(?<!a)b", ["lookaround"]),
        ("a{1,100000}", ["100000", "max_pattern_repeat"]),
        ("a{5000}", ["max_pattern_repeat"]),
        ("a" * 2000, ["max_pattern_chars"]),
        ("(ab", ["unclosed"]),
        ("ab)", ["unbalanced"]),
        ("[ab", ["unclosed"]),
    ],
)
def test_costly_or_unguidable_patterns_are_refused(pattern, words):
    problem = pattern_problem(pattern, LIMITS)
    assert problem is not None, pattern
    for word in words:
        assert word in problem, problem


def test_combinations_each_name_the_first_problem_found():
    message = refused(
        {
            "type": "object",
            "properties": {
                "a": {"type": "array", "maxItems": 10},
                "b": {"type": "string", "maxLength": 20_000},
                "c": {"enum": list(range(2000))},
            },
        }
    )
    assert "$.properties.b.maxLength" in message


def test_iter_subschemas_walks_definitions_once_without_following_refs():
    paths = [path for path, _ in iter_subschemas(ORDER)]
    assert paths[0] == "$"
    assert "$.$defs.line" in paths and "$.$defs.line.properties.sku" in paths
    assert paths.count("$.$defs.line") == 1 and "$.properties.lines.items" in paths
    assert not any(".$ref" in path for path in paths)


def test_parse_schema_refuses_bad_text_with_invalid_argument():
    for text, words in [
        ("{", ["not valid JSON"]),
        ("[]", ["JSON Schema object"]),
        ('{"maxItems": ' + "9" * 5000 + "}", ["not usable JSON"]),
        ("[" * 60_000, ["nests deeper"]),
        (json.dumps({"minLength": 10**9}), ["max_length"]),
        (" " * (LIMITS.max_chars + 1), ["max_chars"]),
    ]:
        with pytest.raises(InvalidArgument) as caught:
            parse_schema(text, LIMITS)
        for word in words:
            assert word in caught.value.message, (text[:40], caught.value.message)
    assert parse_schema(json.dumps(ORDER), LIMITS) == ORDER
