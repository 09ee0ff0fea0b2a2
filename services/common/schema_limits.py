"""Bounds on what a JSON Schema may cost, checked before anything compiles or validates it.

A schema is a program: `{"type": "array", "minItems": 1000000000}` makes a grammar compiler
(llguidance, vLLM's) build a billion-item grammar, `"pattern": "^(a+)+$"` makes a backtracking
regex engine (the router's validator) take exponential time, and a chain of `$defs` that
each reference the one before twice doubles the work per link. `check_schema_limits` walks
a parsed schema once (following local `$ref`s, each target counted where it is used) and
refuses, with InvalidArgument naming the limit and the JSON path, anything over `SchemaLimits`.
The router checks every request's schema with it; workers check again before compiling a
grammar, so a request from a router of another version is bounded too.

Pure: no I/O, and it imports nothing of any service.
"""

from __future__ import annotations

import json
from typing import Any, Iterator
from urllib.parse import unquote

from pydantic import Field

from services.common.config import Section
from services.common.errors import InvalidArgument

# Formats both the router's validator and llguidance's grammar understand; any other is refused
# rather than silently unenforced on one side.
GUIDED_FORMATS = ("date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "time", "uri", "uuid")


class SchemaLimits(Section):
    """What one response_format JSON Schema may ask for. Defaults fit real clients (objects of
    a few hundred fields, arrays of a few hundred items, strings of a few thousand characters)
    and keep a worker's grammar under about 50 MB and 0.1 s to compile."""

    max_chars: int = Field(64 * 1024, gt=0, description="Longest schema text (characters).")
    max_depth: int = Field(
        32, ge=1, description="Deepest nesting of subschemas ($refs followed; recursion counts once)."
    )
    max_json_depth: int = Field(64, ge=1, description="Deepest nesting of the schema's JSON itself (values included).")
    max_subschemas: int = Field(
        4000,
        ge=1,
        description="Most subschemas, each $ref target counted at every use (a $defs chain that "
        "references each link twice doubles per link).",
    )
    max_items: int = Field(
        1000, ge=0, description="Largest minItems, maxItems, minContains, maxContains, and longest prefixItems."
    )
    max_total_items: int = Field(
        8000, ge=0, description="Sum of the item counts above over the whole schema (a grammar holds each item)."
    )
    max_length: int = Field(10_000, ge=0, description="Largest minLength / maxLength (characters).")
    max_properties: int = Field(
        1000, ge=0, description="Largest minProperties / maxProperties, and most entries in one properties map."
    )
    max_enum: int = Field(1000, ge=1, description="Most values in one enum.")
    max_branches: int = Field(128, ge=1, description="Most subschemas in one anyOf, oneOf or allOf.")
    max_pattern_chars: int = Field(1000, ge=1, description="Longest pattern / patternProperties key.")
    max_pattern_repeat: int = Field(1000, ge=1, description="Largest count in a pattern's {n} / {n,m}.")
    formats: list[str] = Field(
        default_factory=lambda: list(GUIDED_FORMATS),
        description="`format` values allowed (those guided decoding can enforce); others are refused.",
    )


# Keywords whose value is one subschema; does applying it descend into the instance?
_ONE = {
    "not": False,
    "if": False,
    "then": False,
    "else": False,
    "items": True,
    "additionalItems": True,
    "additionalProperties": True,
    "unevaluatedItems": True,
    "unevaluatedProperties": True,
    "contains": True,
    "propertyNames": True,
    "contentSchema": True,
}
_LIST = {"allOf": False, "anyOf": False, "oneOf": False, "prefixItems": True, "items": True}
_MAP = {
    "properties": True,
    "patternProperties": True,
    "dependentSchemas": False,
    "dependencies": False,
    "$defs": None,
    "definitions": None,
}  # None: definitions apply only where a $ref uses them
_ITEM_COUNTS = ("minItems", "maxItems", "minContains", "maxContains")
_LENGTHS = ("minLength", "maxLength")
_PROPERTY_COUNTS = ("minProperties", "maxProperties")
_BRANCHES = ("anyOf", "oneOf", "allOf")


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value (iterative: any depth is safe to measure); stops
    counting once past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_schema(text: str, limits: SchemaLimits, *, what: str = "response_format") -> dict:
    """`text` parsed as a JSON Schema object within `limits`; InvalidArgument naming the
    problem otherwise. What a worker runs before any grammar compiler sees a schema."""
    if len(text) > limits.max_chars:
        raise InvalidArgument(f"{what} is {len(text)} characters; the limit is {limits.max_chars} (limit max_chars)")
    try:
        document = json.loads(text)
    except RecursionError:
        raise InvalidArgument(
            f"{what} nests deeper than {limits.max_json_depth} levels (limit max_json_depth)"
        ) from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc.msg}") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise InvalidArgument(f"{what} is not usable JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidArgument(f"{what} must be a JSON Schema object")
    check_schema_limits(document, limits, what=what)
    return document


def check_schema_limits(document: Any, limits: SchemaLimits, *, what: str = "response_format") -> None:
    """Raises InvalidArgument naming the limit and the JSON path of the first part of
    `document` (a parsed schema) that is over `limits`; `what` names the field in messages."""
    if json_depth(document, limits.max_json_depth) > limits.max_json_depth:
        raise InvalidArgument(f"{what} nests deeper than {limits.max_json_depth} levels (limit max_json_depth)")
    _Walk(document, limits, what).run()


class _Walk:
    """One pass over a schema: the expanded subschema count, depth, in-place $ref cycles, and
    every keyword's own bound."""

    def __init__(self, root: Any, limits: SchemaLimits, what: str) -> None:
        self.root, self.limits, self.what = root, limits, what
        self.formats = frozenset(limits.formats)
        self.expanded = 0
        self.total_items = 0
        # id(node) -> height, for nodes already measured (a $ref target used again costs its
        # count again but is not walked again).
        self.heights: dict[int, int] = {}
        self.counts: dict[int, int] = {}
        self.checked: set[int] = set()
        # id(node) on the current path -> how many instance descents lay before it.
        self.path: dict[int, int] = {}

    def fail(self, message: str) -> None:
        raise InvalidArgument(f"{self.what}: {message}")

    def run(self) -> None:
        self.anchors = _anchors(self.root)
        self.visit(self.root, "$", 1, 0)
        # Definitions no $ref reaches cost nothing to apply, but a compiler may still build them.
        for where, node in iter_subschemas(self.root):
            if isinstance(node, dict):
                self.keywords(node, where)

    def visit(self, node: Any, where: str, depth: int, descents: int) -> tuple[int, int]:
        """Walks `node` at `depth`; returns (its height, its expanded subschema count)."""
        if not isinstance(node, dict):
            return 0, 0  # true/false (or a value the meta-schema refuses later)
        key = id(node)
        if key in self.path:
            if self.path[key] == descents:
                self.fail(
                    f"$ref at {where} leads back to a schema that holds it without descending into "
                    "the value (infinite recursion)"
                )
            return 0, 0  # recursion through properties/items: bounded by the value itself
        if key in self.heights:
            return self.add(key, where, depth)
        if depth > self.limits.max_depth:
            self.fail(f"subschemas nest deeper than {self.limits.max_depth} at {where} (limit max_depth)")
        self.expanded += 1
        self.over_count(where)
        before = self.expanded
        self.path[key] = descents
        height = 0
        try:
            self.keywords(node, where)
            for child, child_where, descends in _children(node, where):
                h, _ = self.visit(child, child_where, depth + 1, descents + (1 if descends else 0))
                height = max(height, h)
            for name in ("$ref", "$dynamicRef"):
                ref = node.get(name)
                if isinstance(ref, str) and ref.startswith("#"):
                    target = _resolve(self.root, ref, self.anchors)
                    if target is not None:
                        h, _ = self.visit(target, f"{where}.{name}", depth + 1, descents)
                        height = max(height, h)
        finally:
            del self.path[key]
        self.heights[key] = height + 1
        self.counts[key] = self.expanded - before + 1
        return height + 1, self.counts[key]

    def add(self, key: int, where: str, depth: int) -> tuple[int, int]:
        """A node measured before, used again (through another $ref)."""
        height, count = self.heights[key], self.counts[key]
        if depth + height - 1 > self.limits.max_depth:
            self.fail(f"subschemas nest deeper than {self.limits.max_depth} at {where} (limit max_depth)")
        self.expanded += count
        self.over_count(where)
        return height, count

    def over_count(self, where: str) -> None:
        if self.expanded > self.limits.max_subschemas:
            self.fail(
                f"more than {self.limits.max_subschemas} subschemas ($refs counted at each use), "
                f"reached at {where} (limit max_subschemas)"
            )

    def keywords(self, node: dict, where: str) -> None:
        """The bounds of one schema object's own keywords (checked once per object)."""
        if id(node) in self.checked:
            return
        self.checked.add(id(node))
        limits = self.limits
        for name in _ITEM_COUNTS:
            value = _number(node.get(name))
            if value is not None:
                self.bound(value, limits.max_items, f"{where}.{name}", "max_items")
        counts = [_number(node.get(name)) or 0 for name in ("minItems", "maxItems")]
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            self.bound(len(prefix), limits.max_items, f"{where}.prefixItems", "max_items", "entries")
            counts.append(len(prefix))
        self.total_items += int(max(counts))
        if self.total_items > limits.max_total_items:
            self.fail(
                f"array item counts add up to over {limits.max_total_items}, reached at {where} (limit max_total_items)"
            )
        for name in _LENGTHS:
            value = _number(node.get(name))
            if value is not None:
                self.bound(value, limits.max_length, f"{where}.{name}", "max_length")
        for name in _PROPERTY_COUNTS:
            value = _number(node.get(name))
            if value is not None:
                self.bound(value, limits.max_properties, f"{where}.{name}", "max_properties")
        properties = node.get("properties")
        if isinstance(properties, dict):
            self.bound(len(properties), limits.max_properties, f"{where}.properties", "max_properties", "entries")
        enum = node.get("enum")
        if isinstance(enum, list):
            self.bound(len(enum), limits.max_enum, f"{where}.enum", "max_enum", "values")
        for name in _BRANCHES:
            branches = node.get(name)
            if isinstance(branches, list):
                self.bound(len(branches), limits.max_branches, f"{where}.{name}", "max_branches", "subschemas")
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in self.formats:
            self.fail(
                f"format {fmt!r} at {where}.format is not supported; use one of "
                f"{', '.join(sorted(self.formats))} (limit formats)"
            )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            self.pattern(pattern, f"{where}.pattern")
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict):
            for i, key in enumerate(patterns):
                self.pattern(key, f"{where}.patternProperties[{i}]")

    def bound(self, value: float, limit: int, where: str, name: str, unit: str = "") -> None:
        if value > limit:
            shown = int(value) if value < 1e18 else value
            self.fail(f"{where} is {shown}{' ' + unit if unit else ''}; the limit is {limit} (limit {name})")

    def pattern(self, pattern: str, where: str) -> None:
        problem = pattern_problem(pattern, self.limits)
        if problem is not None:
            self.fail(f"pattern at {where} {problem}")


def iter_subschemas(document: Any, where: str = "$") -> Iterator[tuple[str, Any]]:
    """Every subschema written in `document` (definitions included, each once; $refs not
    followed), with its JSON path, parents first. Iterative: safe at any depth."""
    stack = [(where, document)]
    while stack:
        path, node = stack.pop()
        yield path, node
        if isinstance(node, dict):
            found = list(_children(node, path, definitions=True))
            stack.extend((child_path, child) for child, child_path, _ in reversed(found))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _children(node: dict, where: str, definitions: bool = False) -> Iterator[tuple[Any, str, bool]]:
    """(subschema, its JSON path, whether applying it descends into the instance); with
    `definitions`, the entries of $defs / definitions too."""
    for name, value in node.items():
        if name in _ONE and isinstance(value, (dict, bool)):
            yield value, f"{where}.{name}", _ONE[name]
        elif name in _LIST and isinstance(value, list):
            for i, child in enumerate(value):
                yield child, f"{where}.{name}[{i}]", _LIST[name]
        elif name in _MAP and isinstance(value, dict):
            descends = _MAP[name]
            if descends is None and not definitions:
                continue  # definitions are walked where a $ref reaches them
            for key, child in value.items():
                if isinstance(child, (dict, bool)):
                    yield child, f"{where}.{name}.{key}", bool(descends)


def _anchors(root: Any) -> dict[str, Any]:
    """Plain-name fragments ('#item') and the subschemas that declare them ($anchor,
    $dynamicAnchor, or an older draft's "$id": "#item")."""
    found: dict[str, Any] = {}
    for _where, node in iter_subschemas(root):
        if isinstance(node, dict):
            for name in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(name), str):
                    found.setdefault(node[name], node)
            ident = node.get("$id")
            if isinstance(ident, str) and ident.startswith("#") and len(ident) > 1:
                found.setdefault(ident[1:], node)
    return found


def _resolve(root: Any, ref: str, anchors: dict[str, Any]) -> Any:
    """The node a local `$ref` names ('#', '#/$defs/x', '#item'), or None (dangling refs are
    left to the validator's own check)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return anchors.get(unquote(ref[1:]))
    node = root
    for part in unquote(ref[2:]).split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


# --- patterns ------------------------------------------------------------------------------

_QUANTIFIERS = "*+?{"
# Most repeats of a variable-length group: 2**10 ways to split a string at worst.
_FEW_REPEATS = 10


def pattern_problem(pattern: str, limits: SchemaLimits) -> str | None:
    """Why a `pattern` is refused, or None. Refused: over max_pattern_chars; counts over
    max_pattern_repeat; a quantified group that holds a quantifier (`(a+)+`, `(a?){30}`) or,
    repeated without bound, alternatives that may start alike (`(a|aa)*`): both backtrack
    exponentially in the router's validator; backreferences and lookarounds, which guided
    decoding cannot enforce."""
    if len(pattern) > limits.max_pattern_chars:
        return f"is {len(pattern)} characters; the limit is {limits.max_pattern_chars} (limit max_pattern_chars)"
    try:
        return _Scan(pattern, limits.max_pattern_repeat).run()
    except _Bad as bad:
        return str(bad)


class _Bad(Exception):
    pass


class _Group:
    __slots__ = ("quantified_inside", "alternatives", "first")

    def __init__(self) -> None:
        # Holds a quantifier of variable count (?, *, +, {n,m}): the group's length varies.
        self.quantified_inside = False
        self.alternatives = 1
        # The first atom of each alternative: a literal character, or None (a class, '.', a
        # group or an escape: anything that may overlap another alternative).
        self.first: list[str | None] = []


class _Scan:
    """A single left-to-right pass over an ECMA-262 / Python regex, tracking groups."""

    def __init__(self, pattern: str, max_repeat: int) -> None:
        self.p, self.i, self.max_repeat = pattern, 0, max_repeat

    def run(self) -> str | None:
        stack = [_Group()]
        last_atom: _Group | str | None = None  # the atom a quantifier would apply to
        at_start = True  # at the start of an alternative (its first atom decides `first`)
        p = self.p
        while self.i < len(p):
            ch = p[self.i]
            if ch == "\\":
                nxt = p[self.i + 1] if self.i + 1 < len(p) else ""
                if nxt.isdigit() and nxt != "0" or nxt == "k":
                    raise _Bad(
                        f"has a backreference (\\{nxt}) at character {self.i}, which guided decoding cannot enforce"
                    )
                self.i += 2
                if nxt in "xu":
                    self.i += 4 if nxt == "u" else 2
                elif nxt in "pP" and self.i < len(p) and p[self.i] == "{":
                    end = p.find("}", self.i)
                    self.i = len(p) if end < 0 else end + 1
                self.atom(stack, at_start, None)
                last_atom, at_start = "atom", False
            elif ch == "[":
                self.skip_class()
                self.atom(stack, at_start, None)
                last_atom, at_start = "atom", False
            elif ch == "(":
                if p.startswith(("(?=", "(?!", "(?<=", "(?<!"), self.i):
                    raise _Bad(f"has a lookaround at character {self.i}, which guided decoding cannot enforce")
                if p.startswith("(?P=", self.i):
                    raise _Bad(f"has a backreference at character {self.i}, which guided decoding cannot enforce")
                self.atom(stack, at_start, None)
                stack.append(_Group())
                self.i += 1
                if p.startswith("?", self.i):  # (?:...), (?<name>...), (?P<name>...), flags
                    end = p.find(">", self.i) if p.startswith(("?<", "?P<"), self.i) else p.find(":", self.i)
                    self.i = self.i + 1 if end < 0 else end + 1
                last_atom, at_start = None, True
            elif ch == ")":
                if len(stack) == 1:
                    raise _Bad(f"has an unbalanced ')' at character {self.i}")
                group = stack.pop()
                if group.quantified_inside:
                    stack[-1].quantified_inside = True
                self.i += 1
                last_atom, at_start = group, False
            elif ch == "|":
                stack[-1].alternatives += 1
                self.i += 1
                last_atom, at_start = None, True
            elif ch in _QUANTIFIERS and last_atom is not None:
                low, high = self.quantifier()
                if isinstance(last_atom, _Group):
                    # A group of variable length repeated many times splits one string in
                    # exponentially many ways; a few repeats (`( ?\d{4}){4}`) stay cheap.
                    few = high is not None and high <= _FEW_REPEATS
                    if last_atom.quantified_inside and not few:
                        raise _Bad("nests quantifiers (like (a+)+), which backtracks exponentially")
                    if (high is None or high > 1) and last_atom.alternatives > 1 and _may_overlap(last_atom.first):
                        raise _Bad(
                            "repeats alternatives that may start alike (like (a|aa)*), which backtracks "
                            "exponentially; use a character class or disjoint alternatives"
                        )
                if high != low:  # a fixed count ({4}) adds no way to split the string
                    stack[-1].quantified_inside = True
                elif isinstance(last_atom, _Group) and last_atom.quantified_inside:
                    stack[-1].quantified_inside = True
                last_atom = None
            else:
                self.i += 1
                self.atom(stack, at_start, None if ch in ".^$" else ch)
                if ch in "^$":
                    continue  # anchors take no quantifier and do not start an alternative
                last_atom, at_start = "atom", False
        if len(stack) != 1:
            raise _Bad("has an unclosed '('")
        return None

    @staticmethod
    def atom(stack: list[_Group], at_start: bool, literal: str | None) -> None:
        if at_start:
            stack[-1].first.append(literal)

    def skip_class(self) -> None:
        p, i = self.p, self.i + 1
        if i < len(p) and p[i] == "^":
            i += 1
        if i < len(p) and p[i] == "]":
            i += 1
        while i < len(p) and p[i] != "]":
            i += 2 if p[i] == "\\" else 1
        if i >= len(p):
            raise _Bad("has an unclosed '['")
        self.i = i + 1

    def quantifier(self) -> tuple[int, int | None]:
        p = self.p
        ch = p[self.i]
        self.i += 1
        if ch == "{":
            end = p.find("}", self.i)
            body = p[self.i : end] if end >= 0 else ""
            low_text, _, high_text = body.partition(",")
            if end < 0 or not low_text.strip().isdigit() or (high_text.strip() and not high_text.strip().isdigit()):
                # Not a count ("{" taken literally, as ECMA-262 does): a literal atom.
                return 1, 1
            self.i = end + 1
            low = int(low_text)
            high = low if "," not in body else (int(high_text) if high_text.strip() else None)
            biggest = max(low, high or 0)
            if biggest > self.max_repeat:
                raise _Bad(f"repeats {biggest} times; the limit is {self.max_repeat} (limit max_pattern_repeat)")
            result = (low, high)
        elif ch == "?":
            result = (0, 1)
        else:
            result = (0 if ch == "*" else 1, None)
        if self.i < len(p) and p[self.i] in "?+":
            self.i += 1  # lazy or possessive
        return result


def _may_overlap(firsts: list[str | None]) -> bool:
    """Whether two alternatives could match the same first character."""
    if any(f is None for f in firsts):
        return True
    return len(set(firsts)) < len(firsts)
