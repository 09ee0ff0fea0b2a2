"""YAML loading that remembers where every value came from, so errors can name the line.

`yaml.safe_load` forgets positions and silently keeps the last of duplicate keys; this walks
PyYAML's composed node tree instead and returns mappings and lists that carry line numbers
(1-based), rejecting duplicate keys and non-string keys.
"""

from __future__ import annotations

from typing import Any

import yaml


class YamlError(ValueError):
    """The text is not valid YAML (or has duplicate keys); the message names the line."""


class LMap(dict):
    """A mapping with the line of itself (`line`) and of each key (`line_of(key)`)."""

    line: int = 0

    def __init__(self, line: int) -> None:
        super().__init__()
        self.line = line
        self.key_lines: dict[str, int] = {}

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)


class LList(list):
    """A list with the line of itself (`line`) and of each item (`line_of(i)`)."""

    def __init__(self, line: int) -> None:
        super().__init__()
        self.line = line
        self.item_lines: list[int] = []

    def line_of(self, index: int) -> int:
        return self.item_lines[index] if 0 <= index < len(self.item_lines) else self.line


def line_of(value: Any, default: int = 0) -> int:
    return getattr(value, "line", default)


def _convert(node: yaml.Node, loader: yaml.SafeLoader, source: str, depth: int = 0) -> Any:
    line = node.start_mark.line + 1
    if depth > 64:
        raise YamlError(f"{source}:{line}: nesting is too deep")
    if isinstance(node, yaml.MappingNode):
        # Merge keys (<<) are resolved by flatten_mapping, as safe_load would.
        loader.flatten_mapping(node)
        out = LMap(line)
        for key_node, value_node in node.value:
            key_line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlError(f"{source}:{key_line}: keys must be plain strings")
            key = loader.construct_object(key_node)
            if not isinstance(key, str):
                raise YamlError(f"{source}:{key_line}: key {key!r} must be a string")
            if key in out:
                raise YamlError(f"{source}:{key_line}: duplicate key {key!r} (first on line {out.key_lines[key]})")
            out[key] = _convert(value_node, loader, source, depth + 1)
            out.key_lines[key] = key_line
        return out
    if isinstance(node, yaml.SequenceNode):
        items = LList(line)
        for item in node.value:
            items.append(_convert(item, loader, source, depth + 1))
            items.item_lines.append(item.start_mark.line + 1)
        return items
    return loader.construct_object(node)


def load_located(text: str, source: str = "<yaml>") -> Any:
    """Parses one YAML document into LMap / LList / scalars; raises YamlError naming the line."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        return _convert(node, loader, source)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise YamlError(f"{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise YamlError(f"{source}: {exc}") from None
    finally:
        loader.dispose()
