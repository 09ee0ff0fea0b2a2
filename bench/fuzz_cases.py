"""Fuzz cases for Ballast's RPCs, built from the protobuf descriptors: no RPC needs its own
generator, and a field added to a proto is fuzzed the day it lands.

Three kinds of case, each a request frame as bytes (so malformed frames go on the wire as
they are):
  * structured: a message of the RPC's request type with random fields set (extreme and
    out-of-range numbers, NaN and infinities, long and odd Unicode, unknown enum values,
    deep and long repeated fields);
  * mutated: a valid request of the RPC (its template) with a few fields replaced by such
    values, so the case gets past the first checks and reaches deeper code;
  * raw: random bytes, a template with bits flipped, or a template cut short.
Oversized frames (beyond the servers' 64 MiB limit) are built separately: they are heavy.
Pure: the random generator is seeded, so a run can be repeated case for case.
"""

from __future__ import annotations

import math
import random
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e38, -1e38, math.nan, math.inf, -math.inf, 2.0, 100.0)
_ODD_TEXT = (
    "",
    " ",
    "\x00",
    "\ud7ff",
    "é",
    "𝔘𝔫𝔦",
    "\u202e",
    "{",
    "}}}",
    '{"a":',
    "<|im_end|>",
    "\n" * 50,
    "SELECT 1;",
    "../../etc/passwd",
    "%s%n",
    "tiny",
    "local",
    "S",
    "B",
)
_STRING_LENGTHS = (0, 1, 8, 64, 1024, 70_000)
_REPEATS = (0, 1, 2, 3, 16, 300)


def _number(field: FieldDescriptor, rng: random.Random) -> Any:
    low, high = _INT_RANGES[field.type]
    return rng.choice((0, 1, -1 if low < 0 else 2, low, high, rng.randint(low, high), rng.randint(0, 4096)))


def _text(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(_ODD_TEXT)
    length = rng.choice(_STRING_LENGTHS)
    alphabet = 'abcXYZ019 _-{}[]":,\n\t\\é中文🙂'
    return "".join(rng.choice(alphabet) for _ in range(length))


def _scalar(field: FieldDescriptor, rng: random.Random, depth: int) -> Any:
    kind = field.type
    if kind in _INT_RANGES:
        return _number(field, rng)
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        value = rng.choice(_FLOATS) if rng.random() < 0.7 else rng.uniform(-1e6, 1e6)
        return value
    if kind == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == FieldDescriptor.TYPE_STRING:
        return _text(rng)
    if kind == FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 16, 32, 500, 5000)))
    if kind == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return rng.choice(known + [len(known) + 7, -1, 2**31 - 1])
    raise ValueError(f"unexpected field type {kind}")


def _fill_field(message: Message, field: FieldDescriptor, rng: random.Random, depth: int) -> None:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        target = getattr(message, field.name)
        for _ in range(rng.choice(_REPEATS[:5])):
            key = _scalar(key_field, rng, depth)
            if value_field.message_type is not None:
                random_fields(target[key], rng, depth + 1)
            else:
                target[key] = _scalar(value_field, rng, depth)
        return
    repeated = field.is_repeated
    if field.message_type is not None:
        if depth >= 4:
            return
        if repeated:
            container = getattr(message, field.name)
            for _ in range(rng.choice(_REPEATS if depth < 2 else _REPEATS[:4])):
                random_fields(container.add(), rng, depth + 1)
        else:
            random_fields(getattr(message, field.name), rng, depth + 1)
            getattr(message, field.name).SetInParent()
        return
    if repeated:
        getattr(message, field.name).extend(_scalar(field, rng, depth) for _ in range(rng.choice(_REPEATS)))
    else:
        setattr(message, field.name, _scalar(field, rng, depth))


def random_fields(message: Message, rng: random.Random, depth: int = 0, share: float = 0.6) -> Message:
    """Sets a random subset of the message's fields to random values."""
    for field in message.DESCRIPTOR.fields:
        if rng.random() < share:
            _fill_field(message, field, rng, depth)
    return message


def structured_case(request_type: type[Message], rng: random.Random) -> bytes:
    return random_fields(request_type(), rng).SerializeToString()


def mutated_case(template: Message, rng: random.Random) -> bytes:
    message = type(template)()
    message.CopyFrom(template)
    fields = list(message.DESCRIPTOR.fields)
    for field in rng.sample(fields, k=min(len(fields), rng.choice((1, 1, 2, 3)))):
        message.ClearField(field.name) if rng.random() < 0.2 else _fill_field(message, field, rng, 1)
    return message.SerializeToString()


def raw_case(template: Message, rng: random.Random) -> bytes:
    valid = template.SerializeToString()
    choice = rng.random()
    if choice < 0.34 or not valid:
        return rng.randbytes(rng.choice((1, 2, 7, 64, 512, 4096)))
    if choice < 0.67:
        data = bytearray(valid)
        for _ in range(rng.choice((1, 2, 4, 16))):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data)
    return valid[: rng.randrange(len(valid))]


def make_case(request_type: type[Message], template: Message, rng: random.Random) -> tuple[str, bytes]:
    """(kind, frame): half structured, a quarter mutated templates, a quarter raw bytes."""
    roll = rng.random()
    if roll < 0.5:
        return "structured", structured_case(request_type, rng)
    if roll < 0.75:
        return "mutated", mutated_case(template, rng)
    return "raw", raw_case(template, rng)


def oversized_frame(limit_bytes: int) -> bytes:
    """A frame one MiB over the servers' receive limit (a bytes field, validly encoded)."""
    return b"\x0a" + _varint(limit_bytes + (1 << 20)) + b"\x00" * (limit_bytes + (1 << 20))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
