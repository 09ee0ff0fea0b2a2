"""Checks a request's `response_format` once at the edge: JSON, within the schema limits, a
valid JSON Schema, local refs only.

A bad schema is the client's mistake, so it fails the request with InvalidArgument naming
the problem before anything is queued or sent to a worker. The limits (services.common.
schema_limits) come first: they are one linear pass, and they keep the meta-schema check,
the answer's validation and every worker's grammar compiler bounded.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import urljoin

import jsonschema
from jsonschema import validators
from jsonschema.exceptions import best_match
from jsonschema_specifications import REGISTRY as META_SCHEMAS
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from services.common.errors import InvalidArgument
from services.common.schema_limits import SchemaLimits, check_schema_limits, iter_subschemas

JSON_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
# Keywords whose values are data, not subschemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_DEFAULT = validators.Draft202012Validator
_LIMITS = SchemaLimits()


@dataclass(frozen=True)
class Schema:
    """A checked JSON Schema and its validator (draft from `$schema`, default 2020-12)."""

    text: str
    document: dict[str, Any]
    validator: Any = field(compare=False, repr=False)
    registry: Registry = field(compare=False, repr=False)

    @property
    def name(self) -> str:
        """A metric label for the schema: its `title`, else a short hash of its text."""
        title = self.document.get("title") if isinstance(self.document, dict) else None
        if isinstance(title, str) and title:
            return title[:64]
        return "sha256:" + hashlib.sha256(self.text.encode()).hexdigest()[:12]

    def is_valid(self, value: Any) -> bool:
        return self.validator.is_valid(value)

    def errors(self, value: Any, limit: int = 3) -> list[str]:
        """Why `value` does not conform, most relevant first, as 'message (at $.path)'."""
        found = sorted(self.validator.iter_errors(value), key=jsonschema.exceptions.relevance)
        return [f"{e.message} (at {e.json_path})" for e in found[:limit]]

    def subschema_valid(self, subschema: Any, value: Any) -> bool:
        """Whether `value` conforms to a part of this schema (refs resolve against the whole)."""
        return self.validator.evolve(schema=subschema).is_valid(value)

    def resolver(self):
        """A `referencing` resolver rooted at this document, for following local `$ref`s."""
        return self.registry.resolver(base_uri="")


def check_schema(text: str, limits: SchemaLimits | None = None) -> Schema:
    """Parses and checks `text` against `limits` (default: SchemaLimits()) and its draft's
    meta-schema; InvalidArgument if unusable."""
    limits = limits or _LIMITS
    if len(text) > limits.max_chars:
        raise InvalidArgument(
            f"response_format is {len(text)} characters; the limit is {limits.max_chars} (limit max_chars)"
        )
    if not text.strip():
        raise InvalidArgument("response_format is empty; omit it for free text")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(
            f"response_format is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise InvalidArgument(
            f"response_format nests deeper than {limits.max_json_depth} levels (limit max_json_depth)"
        ) from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise InvalidArgument(f"response_format is not usable JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidArgument('response_format must be a JSON Schema object, e.g. {"type": "object", ...}')
    check_schema_limits(document, limits)
    cls = validators.validator_for(document, default=None) if "$schema" in document else _DEFAULT
    if cls is None:
        raise InvalidArgument(f"response_format has an unknown $schema dialect {document.get('$schema')!r}")
    _check_meta(cls, document)
    for path, ref in _refs(document, "$"):
        if not ref.startswith("#"):
            # The router never fetches anything a request names: only in-document refs.
            raise InvalidArgument(
                f"response_format: $ref {ref!r} at {path} is not local; only '#/...' references are supported"
            )
    resource = Resource.from_contents(document, default_specification=DRAFT202012)
    registry = Registry().with_resource(uri="", resource=resource)
    validator = cls(document, registry=registry)
    try:
        # Dangling local refs only surface when validation reaches them; probe them now.
        resolver = registry.resolver(base_uri="")
        for path, ref in _refs(document, "$"):
            resolver.lookup(ref)
    except Exception as exc:  # referencing raises several Unresolvable subclasses
        raise InvalidArgument(f"response_format: $ref at {path} cannot be resolved: {exc}") from None
    return Schema(text=text, document=document, validator=validator, registry=registry)


def _check_meta(cls, document: dict) -> None:
    """Checks each subschema on its own against its draft's meta-schema with the recursion
    cut out: linear in the schema's size, where jsonschema's recursive meta-check costs about
    a millisecond per subschema (a second for a 64 KiB schema)."""
    meta = _shallow_meta(cls)
    for where, node in iter_subschemas(document):
        if isinstance(node, bool):
            continue
        error = best_match(meta.iter_errors(node))
        if error is not None:
            raise InvalidArgument(f"response_format is not a valid JSON Schema: {_describe(error, where)}")


_SELF_REFS = ({"$ref": "#"}, {"$dynamicRef": "#meta"}, {"$recursiveRef": "#"})


@functools.cache
def _shallow_meta(cls):
    """A validator of one schema object's own keywords for draft `cls`: its meta-schema (and
    vocabularies) with every reference back to the meta-schema itself replaced by `true`."""

    def cut(node: Any) -> Any:
        if isinstance(node, dict):
            if node in _SELF_REFS:
                return True
            return {k: cut(v) for k, v in node.items() if k not in ("$dynamicAnchor", "$recursiveAnchor", "$id")}
        if isinstance(node, list):
            return [cut(v) for v in node]
        return node

    root = cls.META_SCHEMA
    documents = [root]
    for entry in root.get("allOf", ()):
        if isinstance(entry, dict) and "$ref" in entry:
            documents.append(META_SCHEMAS.contents(urljoin(root["$id"], entry["$ref"])))
    merged: dict[str, Any] = {"type": ["object", "boolean"], "properties": {}, "$defs": {}, "definitions": {}}
    for document in documents:
        document = cut(copy.deepcopy(document))
        merged["properties"].update(document.get("properties", {}))
        merged["$defs"].update(document.get("$defs", {}))
        merged["definitions"].update(document.get("definitions", {}))
    return cls(merged)


def _describe(error: jsonschema.exceptions.ValidationError, base: str = "$") -> str:
    where = base + error.json_path[1:]
    if error.path and error.path[-1] == "type":
        bad = error.instance if isinstance(error.instance, list) else [error.instance]
        unknown = [t for t in bad if t not in JSON_TYPES]
        if unknown:
            return f"{unknown[0]!r} at {where} is not a JSON type; use one of {', '.join(JSON_TYPES)}"
    return f"{error.message} (at {where})"


def _refs(node: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield path, value
            elif key not in _DATA_KEYWORDS:
                yield from _refs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _refs(value, f"{path}[{i}]")
