"""Validates a model's answer against the request's JSON Schema and repairs what it safely can.

The second net behind guided decoding, for engines without guidance, answers cut by
`max_tokens`, a light model or a rule template. Parsing is lenient (json-repair closes cut
or malformed JSON, text around the document is dropped); conforming fills missing required
fields (schema default, else const, else first enum value, else the type's zero value),
coerces scalars where the meaning is unchanged ("123" <-> 123, "true" -> true), matches enum
values that differ only in case or separators, and drops properties the schema forbids,
through nested objects and arrays. Nothing is invented beyond that: a value that is still
wrong (out of range, unknown enum member) makes the result FAILED, never silently "fixed".

Pure and synchronous: no I/O, so the router can run it inline when a stream finishes.
Longer than most modules on purpose: the repairs are one recursive walk over the schema and
the value, each step needing the others (fill, coerce, match, drop) at every depth.
"""

from __future__ import annotations

import copy
import enum
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import json_repair

from services.router.structured.schema import Schema

# Bound on $ref hops and nesting while conforming: a cyclic schema must not loop.
_MAX_DEPTH = 64
_INT = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


class Status(enum.Enum):
    VALID = "valid"
    REPAIRED = "repaired"
    FAILED = "failed"


class RepairKind(str, enum.Enum):
    """What a repair did; the metric label of `repairs by kind`."""

    EXTRACTED = "extracted"  # text around the JSON document was dropped
    SYNTAX = "syntax"  # malformed JSON fixed (quotes, commas, literals)
    TRUNCATED = "truncated"  # JSON cut off at the end was closed
    FILLED = "filled"  # a missing or null required value was filled in
    COERCED = "coerced"  # a value changed type or spelling, keeping its meaning
    DROPPED = "dropped"  # properties or items the schema forbids were removed


@dataclass(frozen=True)
class Repair:
    kind: RepairKind
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class StructuredResult:
    """Outcome of `repair`. `text` is what the client should treat as the answer: the model's
    own text when VALID, the repaired document when REPAIRED, the raw output when FAILED."""

    status: Status
    value: Any
    text: str
    repairs: tuple[Repair, ...] = ()
    # Why the result FAILED (schema errors, or that no JSON was found); empty otherwise.
    errors: tuple[str, ...] = ()

    @property
    def messages(self) -> list[str]:
        """The repairs as human-readable strings (Finished.structured_repairs)."""
        return [r.message for r in self.repairs]


def repair(output_text: str, schema: Schema) -> StructuredResult:
    """Parse `output_text` leniently, conform it to `schema`, and say how it went."""
    repairs: list[Repair] = []
    parsed = _parse(output_text, _root_opener(schema.document), repairs)
    if parsed is _NOTHING:
        return StructuredResult(Status.FAILED, None, output_text, tuple(repairs), ("no JSON document found",))
    cut = any(r.kind is RepairKind.TRUNCATED for r in repairs)
    value = _Conformer(schema, repairs, cut).conform(parsed, schema.document, schema.resolver(), (), 0)
    if not schema.is_valid(value):
        return StructuredResult(Status.FAILED, value, output_text, tuple(repairs), tuple(schema.errors(value)))
    if not repairs:
        return StructuredResult(Status.VALID, value, output_text.strip())
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return StructuredResult(Status.REPAIRED, value, text, tuple(repairs))


# --- lenient parsing ------------------------------------------------------------------
_NOTHING = object()


def placeholder_answer(schema: Schema) -> StructuredResult:
    """The document an answer made without a model (the rule engine's) gives a JSON request:
    the schema's placeholder (each required field its default, const, first enum value or its
    type's zero value). REPAIRED, with a FILLED repair: it conforms, and says it holds no
    model's values."""
    repairs = [Repair(RepairKind.FILLED, "no model answered: the schema's placeholder values were filled in")]
    value = _Conformer(schema, []).placeholder(schema.document, schema.resolver(), 0)
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    if not schema.is_valid(value):
        return StructuredResult(Status.FAILED, value, text, tuple(repairs), tuple(schema.errors(value)))
    return StructuredResult(Status.REPAIRED, value, text, tuple(repairs))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _root_opener(document: Any) -> str:
    """The character the answer should start with, from the root schema's type."""
    types = _types(document) if isinstance(document, dict) else []
    if types == ["object"] or (not types and isinstance(document, dict) and "properties" in document):
        return "{"
    if types == ["array"]:
        return "["
    return ""


def _parse(text: str, opener: str, repairs: list[Repair]) -> Any:
    stripped = text.strip()
    if not stripped:
        return _NOTHING
    try:
        return json.loads(stripped, parse_constant=_reject_constant)
    except ValueError:
        pass
    start = _find_start(stripped, opener)
    if start >= 0:
        try:
            value, _end = json.JSONDecoder(parse_constant=_reject_constant).raw_decode(stripped, start)
        except ValueError:
            pass
        else:
            repairs.append(Repair(RepairKind.EXTRACTED, "extracted the JSON document from the text around it"))
            return value
    candidate = stripped[start:] if start >= 0 else stripped
    value = _lenient(_drop_cut_key(candidate) if start >= 0 else candidate, stripped[start] if start >= 0 else "")
    if value is _NOTHING:
        return _NOTHING
    if start > 0:
        repairs.append(Repair(RepairKind.EXTRACTED, "extracted the JSON document from the text around it"))
    if start >= 0 and not _closed(candidate):
        repairs.append(Repair(RepairKind.TRUNCATED, "completed JSON that was cut off"))
    else:
        repairs.append(Repair(RepairKind.SYNTAX, "fixed malformed JSON"))
    return value


def _find_start(text: str, opener: str) -> int:
    if opener:
        return text.find(opener)
    found = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    return min(found) if found else -1


def _scan(candidate: str) -> tuple[bool, int]:
    """Brackets of the document starting `candidate`, outside double-quoted strings (not a
    parser): whether its outermost bracket closes, and, when it was cut off in an object key
    or right after one (before its colon), where that key starts (else -1)."""
    stack: list[str] = []
    in_string = escaped = expect_key = False
    key_start = -1
    for i, ch in enumerate(candidate):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            key_start = i if expect_key else -1
            expect_key = False
        elif ch in "{[":
            stack.append(ch)
            expect_key, key_start = ch == "{", -1
        elif ch in "}]":
            if stack:
                stack.pop()
            if not stack:
                return True, -1
            expect_key, key_start = False, -1
        elif ch == ",":
            expect_key, key_start = bool(stack) and stack[-1] == "{", -1
        elif ch == ":":
            expect_key, key_start = False, -1
    return False, key_start


def _closed(candidate: str) -> bool:
    return _scan(candidate)[0]


def _drop_cut_key(candidate: str) -> str:
    """A document cut inside an object key ('[{"sku":"A1"},{"sk') loses that partial key, so
    json-repair closes what came before instead of guessing what the fragment was."""
    closed, key_start = _scan(candidate)
    if closed or key_start < 0:
        return candidate
    return candidate[:key_start].rstrip().rstrip(",")


def _lenient(candidate: str, opener: str) -> Any:
    value = _json_repair(candidate)
    want = {"{": dict, "[": list}.get(opener)
    if want is not None and not isinstance(value, want):
        # A document cut inside a key ('{"pro') comes back as some other type: cut back to
        # the last complete member and let json-repair close what is left.
        for cut in _cut_points(candidate):
            value = _json_repair(candidate[:cut])
            if isinstance(value, want):
                return value
        return _NOTHING
    if value == "" and '""' not in candidate:
        return _NOTHING  # json-repair's answer for text with no JSON in it
    return value


def _json_repair(text: str) -> Any:
    try:
        return json_repair.loads(text)
    except Exception:  # a repair library must not fail the stream; treat as no JSON
        return _NOTHING


def _cut_points(candidate: str, limit: int = 8) -> list[int]:
    points = [i for i, ch in enumerate(candidate) if ch == ","][-limit:][::-1]
    return points + [1]


# --- conforming -----------------------------------------------------------------------
def _types(node: dict) -> list[str]:
    declared = node.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    return []


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _fits_type(value: Any, types: list[str]) -> bool:
    kind = _json_type(value)
    return not types or kind in types or (kind == "integer" and "number" in types)


def _show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, default=str)


def _where(path: tuple) -> str:
    if not path:
        return "the answer"
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return f"'{out}'"


def _norm(text: str) -> str:
    return re.sub(r"[\s\-_]+", "_", text.strip().lower())


class _Conformer:
    def __init__(self, schema: Schema, repairs: list[Repair], cut: bool = False) -> None:
        self.schema = schema
        self.repairs = repairs
        # The output was cut off, so a string may be the start of what the model meant.
        self.cut = cut

    def note(self, kind: RepairKind, message: str) -> None:
        self.repairs.append(Repair(kind, message))

    def conform(self, value: Any, node: Any, resolver: Any, path: tuple, depth: int) -> Any:
        if not isinstance(node, dict) or depth > _MAX_DEPTH:
            return value  # true/false schemas and runaway recursion: nothing to repair
        if isinstance(node.get("$ref"), str):
            target, resolver = self.resolve(node["$ref"], resolver)
            if target is not None:
                value = self.conform(value, target, resolver, path, depth + 1)
        for sub in node.get("allOf") or ():
            value = self.conform(value, sub, resolver, path, depth + 1)
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                value = self.one_of(value, node[key], resolver, path, depth)
        value = self.scalar(value, node, resolver, path)
        if isinstance(value, dict):
            value = self.object(value, node, resolver, path, depth)
        elif isinstance(value, list):
            value = self.array(value, node, resolver, path, depth)
        return value

    def resolve(self, ref: str, resolver: Any) -> tuple[Any, Any]:
        try:
            resolved = resolver.lookup(ref)
        except Exception:  # unresolvable refs were rejected up front; be safe anyway
            return None, resolver
        return resolved.contents, resolved.resolver

    def one_of(self, value: Any, branches: list, resolver: Any, path: tuple, depth: int) -> Any:
        if any(self.schema.subschema_valid(b, value) for b in branches):
            return value
        for branch in branches:
            trial: list[Repair] = []
            candidate = _Conformer(self.schema, trial, self.cut).conform(
                copy.deepcopy(value), branch, resolver, path, depth + 1
            )
            if self.schema.subschema_valid(branch, candidate):
                self.repairs.extend(trial)
                return candidate
        return value

    def scalar(self, value: Any, node: dict, resolver: Any, path: tuple) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            filled = self.placeholder(node, resolver, 0)
            self.note(RepairKind.FILLED, f"replaced non-finite {_where(path)} with {_show(filled)}")
            return filled
        if self.cut and value == "" and not self.schema.subschema_valid(node, ""):
            # json-repair's value for a key cut off before its value ('"gift":'): missing.
            filled = self.placeholder(node, resolver, 0)
            self.note(RepairKind.FILLED, f"filled {_where(path)}, cut off before its value, with {_show(filled)}")
            return filled
        if "const" in node:
            if value != node["const"]:
                self.note(RepairKind.COERCED, f"set {_where(path)} to its constant {_show(node['const'])}")
                return copy.deepcopy(node["const"])
            return value
        types = _types(node)
        if value is None and types and "null" not in types:
            filled = self.placeholder(node, resolver, 0)
            self.note(RepairKind.FILLED, f"replaced null {_where(path)} with {_show(filled)}")
            return filled
        if types and not _fits_type(value, types):
            for target in types:
                ok, coerced = _coerce(value, target)
                if ok:
                    self.note(RepairKind.COERCED, f"converted {_where(path)} from {_show(value)} to {_show(coerced)}")
                    value = coerced
                    break
            else:
                if self.cut and isinstance(value, str):
                    ok, completed = _complete_cut(value, types)
                    if ok:
                        self.note(
                            RepairKind.TRUNCATED,
                            f"completed cut-off {_where(path)} from {_show(value)} to {_show(completed)}",
                        )
                        value = completed
        if isinstance(node.get("enum"), list) and value not in node["enum"]:
            match = _enum_match(value, node["enum"])
            if match is not _NOTHING:
                self.note(RepairKind.COERCED, f"changed {_where(path)} from {_show(value)} to {_show(match)}")
                value = match
            elif self.cut and isinstance(value, str):
                starts = [m for m in node["enum"] if isinstance(m, str) and m.startswith(value)]
                if len(starts) == 1:
                    self.note(
                        RepairKind.TRUNCATED,
                        f"completed cut-off {_where(path)} from {_show(value)} to {_show(starts[0])}",
                    )
                    value = starts[0]
        return value

    def object(self, value: dict, node: dict, resolver: Any, path: tuple, depth: int) -> dict:
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
        extra = node.get("additionalProperties", True)
        out: dict[str, Any] = {}
        for key, item in value.items():
            child = (*path, key)
            if key in properties:
                out[key] = self.conform(item, properties[key], resolver, child, depth + 1)
                continue
            matched = [s for p, s in patterns.items() if _search(p, key)]
            if matched:
                for sub in matched:
                    item = self.conform(item, sub, resolver, child, depth + 1)
                out[key] = item
            elif extra is False:
                self.note(RepairKind.DROPPED, f"dropped {_where(child)} (not allowed by the schema)")
            else:
                out[key] = self.conform(item, extra, resolver, child, depth + 1) if isinstance(extra, dict) else item
        for key in node.get("required") or ():
            if key in out or key not in properties:
                continue  # undeclared required keys have no schema to fill them from
            filled = self.placeholder(properties[key], resolver, depth + 1)
            out[key] = filled
            self.note(RepairKind.FILLED, f"filled missing {_where((*path, key))} with {_show(filled)}")
        return out

    def array(self, value: list, node: dict, resolver: Any, path: tuple, depth: int) -> list:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        items = node.get("items")
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, node.get("additionalItems")
        value = self.drop_cut_item(value, prefix, items, node, resolver, path)
        out = []
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else items
            out.append(self.conform(item, sub, resolver, (*path, i), depth + 1) if isinstance(sub, dict) else item)
        limit = node.get("maxItems")
        if isinstance(limit, int) and len(out) > limit:
            extra = len(out) - limit
            self.note(
                RepairKind.DROPPED,
                f"dropped {extra} item{'s' if extra > 1 else ''} of {_where(path)} beyond maxItems {limit}",
            )
            out = out[:limit]
        return out

    def drop_cut_item(self, value: list, prefix: list, items: Any, node: dict, resolver: Any, path: tuple) -> list:
        """In a cut-off output, a last object item missing required fields was cut in the
        middle: dropping it keeps the array truthful, where filling it would invent an item."""
        if not self.cut or not value or not isinstance(value[-1], dict):
            return value
        sub = prefix[len(value) - 1] if len(value) - 1 < len(prefix) else items
        if isinstance(sub, dict) and isinstance(sub.get("$ref"), str):
            sub, _ = self.resolve(sub["$ref"], resolver)
        required = sub.get("required") if isinstance(sub, dict) else None
        if not required or all(key in value[-1] for key in required):
            return value
        if len(value) - 1 < (node.get("minItems") or 0):
            return value
        self.note(RepairKind.TRUNCATED, f"dropped the cut-off last item of {_where(path)}")
        return value[:-1]

    def placeholder(self, node: Any, resolver: Any, depth: int) -> Any:
        """The value for a missing field: default, const, first enum value, else the zero
        value of its (first) type, with an object's own required fields filled in turn."""
        if not isinstance(node, dict) or depth > _MAX_DEPTH:
            return None
        if isinstance(node.get("$ref"), str):
            target, inner = self.resolve(node["$ref"], resolver)
            if target is not None and not ({"default", "const", "enum", "type"} & node.keys()):
                return self.placeholder(target, inner, depth + 1)
        for key in ("default", "const"):
            if key in node:
                return copy.deepcopy(node[key])
        if isinstance(node.get("enum"), list) and node["enum"]:
            return copy.deepcopy(node["enum"][0])
        types = _types(node)
        if not types:
            for key in ("anyOf", "oneOf", "allOf"):
                if isinstance(node.get(key), list) and node[key]:
                    return self.placeholder(node[key][0], resolver, depth + 1)
            if "properties" in node:
                types = ["object"]
        kind = types[0] if types else "null"
        if kind == "object":
            quiet = _Conformer(self.schema, [], self.cut)
            return quiet.object({}, node, resolver, (), depth + 1)
        if kind in ("number", "integer"):
            return _bounded_zero(node, kind == "integer")
        return {"string": "", "boolean": False, "array": [], "null": None}.get(kind)


def _bounded_zero(node: dict, integer: bool) -> int | float:
    """0, or the nearest number to it that the schema's bounds allow."""

    def bound(key: str) -> float | None:
        value = node.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    low, high = bound("minimum"), bound("maximum")
    low_x, high_x = bound("exclusiveMinimum"), bound("exclusiveMaximum")
    if low is not None and low > 0:
        value = math.ceil(low) if integer else low
    elif low_x is not None and low_x >= 0:
        value = math.floor(low_x) + 1 if integer else low_x + 1
    elif high is not None and high < 0:
        value = math.floor(high) if integer else high
    elif high_x is not None and high_x <= 0:
        value = math.ceil(high_x) - 1 if integer else high_x - 1
    else:
        return 0
    return int(value) if integer or float(value).is_integer() else value


def _search(pattern: str, key: str) -> bool:
    try:
        return re.search(pattern, key) is not None
    except re.error:  # ECMA-262 syntax Python lacks: no match, no repair
        return False


def _coerce(value: Any, target: str) -> tuple[bool, Any]:
    """Converts a scalar to `target` when the meaning cannot change; (False, None) otherwise."""
    if isinstance(value, str):
        text = value.strip()
        if target == "integer":
            if _INT.match(text):
                return True, int(text)
            if _FLOAT.match(text) and float(text).is_integer() and math.isfinite(float(text)):
                return True, int(float(text))
        if target == "number" and _FLOAT.match(text) and math.isfinite(float(text)):
            return True, int(text) if _INT.match(text) else float(text)
        if target == "boolean" and text.lower() in ("true", "false"):
            return True, text.lower() == "true"
        if target == "null" and text.lower() == "null":
            return True, None
        ok, decoded = _decode_nested(value, target)
        if ok:
            return True, decoded
        return (True, [value]) if target == "array" else (False, None)
    if isinstance(value, bool):
        if target == "string":
            return True, "true" if value else "false"
        return False, None
    if isinstance(value, (int, float)):
        if target == "string":
            return True, _show(value)
        if target == "integer" and float(value).is_integer():
            return True, int(value)
        return False, None
    if target == "array" and not isinstance(value, list):
        return True, [value]
    return False, None


def _decode_nested(text: str, target: str) -> tuple[bool, Any]:
    """A JSON object or array sent as a string (double-encoded): decoded, when it parses."""
    want = {"object": dict, "array": list}.get(target)
    if want is None or not text.lstrip().startswith(("{", "[")):
        return False, None
    try:
        decoded = json.loads(text)
    except ValueError:
        return False, None
    return (True, decoded) if isinstance(decoded, want) else (False, None)


def _complete_cut(text: str, types: list[str]) -> tuple[bool, Any]:
    """The literal or number a cut-off output had started: json-repair returns "fa" for a cut
    `false` and "1e" for a cut `1e-5`. An empty start of a number completes to 0."""
    if text and "boolean" in types:
        for literal, meaning in (("true", True), ("false", False)):
            if literal.startswith(text):
                return True, meaning
    if text and "null" in types and "null".startswith(text):
        return True, None
    if "number" in types or "integer" in types:
        start = text.rstrip("eE+-.")
        if not start:
            return True, 0
        if _FLOAT.match(start):
            number = float(start)
            if math.isfinite(number):
                exact = _INT.match(start) or ("integer" in types and number.is_integer())
                return True, int(number) if exact else number
    return False, None


def _enum_match(value: Any, members: list) -> Any:
    """The enum member `value` means: same text up to case and separators, or same number."""
    if isinstance(value, str):
        wanted = _norm(value)
        for member in members:
            if isinstance(member, str) and _norm(member) == wanted:
                return member
        ok, number = _coerce(value, "number")
        if ok:
            for member in members:
                if isinstance(member, (int, float)) and not isinstance(member, bool) and member == number:
                    return member
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        for member in members:
            if isinstance(member, str) and member.strip() == _show(value):
                return member
    return _NOTHING
