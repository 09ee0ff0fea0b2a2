"""OpenAI request bodies as Ballast `GenerateRequest`s (pure: no I/O).

Chat messages become a conversation, a completions prompt a raw prompt; sampling fields map
one to one. `response_format` json_schema / json_object becomes Ballast's JSON Schema (guided
and validated); `service_tier` (priority -> S, default/auto -> AUTO, flex -> B) or the
`x-ballast-tier` header sets the tier (the header wins); `x-ballast-session-id` sets the
session (KV affinity); `x-ballast-allow-degraded: false` refuses degraded answers. `user`,
`metadata` and `store` are accepted and ignored. Fields Ballast does not serve (n > 1, tools,
logprobs...) are refused naming the field, never silently dropped. Everything the gRPC path
checks (limits, roles, schema) is left to it, so both edges refuse alike.

Text that cannot be encoded is refused here, once, before anything encodes it (protobuf, the
tokenizer, gRPC metadata): a body that is not UTF-8, a string holding a lone surrogate (JSON
lets `"\ud800"` through), a header Ballast reads that is not printable ASCII.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ballast.v1 import inference_pb2
from services.common.tier import Tier
from services.common.tier_pb import tier_to_pb
from services.router.openai.errors import InvalidField, NotJson, UnsupportedField

MAX_JSON_DEPTH = 64
TIER_HEADER = "x-ballast-tier"
SESSION_HEADER = "x-ballast-session-id"
ALLOW_DEGRADED_HEADER = "x-ballast-allow-degraded"
SERVICE_TIERS = {"auto": Tier.AUTO, "default": Tier.AUTO, "priority": Tier.S, "flex": Tier.B}
HEADER_TIERS = {"auto": Tier.AUTO, "s": Tier.S, "a": Tier.A, "b": Tier.B}
# Fields refused unless they hold their neutral value (absent, null, or the value listed).
UNSUPPORTED_UNLESS = {
    "n": (1,),
    "best_of": (1,),
    "tools": ((),),
    "tool_choice": ("none",),
    "functions": ((),),
    "function_call": ("none",),
    "parallel_tool_calls": (),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "echo": (False,),
    "suffix": ("",),
    "audio": (),
    "modalities": ((), ("text",)),
    "prediction": (),
}
# OpenAI's newer name for the system role.
ROLE_ALIASES = {"developer": "system"}
# Headers the request path reads (as call metadata, into protobuf, forwarded on gRPC calls):
# their values must be printable ASCII, as gRPC metadata requires. Others are never read.
READ_HEADERS = frozenset({"x-api-key", "authorization", "traceparent", "tracestate"})
READ_HEADER_PREFIX = "x-ballast-"
_NOT_PRINTABLE_ASCII = re.compile(r"[^\t\x20-\x7e]")


@dataclass(frozen=True)
class Shape:
    """How the answer goes back: which endpoint, streamed or not, with a usage chunk or not."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The body as JSON; raises NotJson when it is not UTF-8, does not parse or nests deeper
    than `max_depth`, and InvalidField naming the first string that holds a lone surrogate."""
    try:
        # Strict UTF-8 (JSON's only encoding between systems): json.loads on bytes would
        # decode with surrogatepass and let encoded surrogates through.
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotJson(f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise NotJson(f"the body is not valid JSON: {exc.__class__.__name__}") from None
    if _depth(value) > max_depth:
        raise NotJson(f"the body nests deeper than {max_depth} levels")
    # Valid UTF-8 holds no surrogate: only a \uD800-\uDFFF escape makes one, so a body
    # without such an escape needs no walk (nearly every body; a pair is an emoji).
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(value)
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse_lone_surrogates(value: Any) -> None:
    """Raises InvalidField naming the first key or string (as a JSON path) that holds a
    surrogate without its pair: no encoder downstream can write it."""
    stack: list[tuple[Any, str]] = [(value, "body")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                raise InvalidField(
                    path,
                    f"{path} holds a lone surrogate (an unpaired \\uD800-\\uDFFF escape): "
                    "strings must be valid Unicode",
                )
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                where = f"{path}.{key}" if path != "body" else key
                if not _encodable(key):
                    raise InvalidField(
                        path,
                        f"a key of {path} holds a lone surrogate (an unpaired "
                        "\\uD800-\\uDFFF escape): strings must be valid Unicode",
                    )
                stack.append((child, where))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in reversed(list(enumerate(item))))


def check_headers(headers: Iterable[tuple[str, str]]) -> None:
    """Raises InvalidField naming the first header Ballast reads whose value is not printable
    ASCII (names lower-case)."""
    for name, value in headers:
        if (name in READ_HEADERS or name.startswith(READ_HEADER_PREFIX)) and _NOT_PRINTABLE_ASCII.search(value):
            raise InvalidField(name, f"header {name} must be printable ASCII (send other text percent-encoded)")


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in item)
    return deepest


def _neutral(value: Any, allowed: tuple) -> bool:
    if value is None:
        return True
    for neutral in allowed:
        if isinstance(neutral, tuple) and isinstance(value, list) and tuple(value) == neutral:
            return True
        if not isinstance(neutral, tuple) and type(value) is type(neutral) and value == neutral:
            return True
    return False


def _int(body: Mapping, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidField(name, f"{name} must be an integer")
    return value


def _number(body: Mapping, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidField(name, f"{name} must be a number")
    return float(value)


def _bool(body: Mapping, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidField(name, f"{name} must be a boolean")
    return value


def _content(message: Mapping, index: int) -> str:
    content = message.get("content")
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidField(param, f"{param}: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidField(param, f"{param} must be a string or a list of text parts")


def _messages(body: Mapping) -> list[inference_pb2.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidField("messages", "messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidField(f"messages[{i}]", f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidField(f"messages[{i}].role", f"messages[{i}].role must be a string")
        for name in ("tool_calls", "function_call"):
            if message.get(name):
                raise UnsupportedField(f"messages[{i}].{name}")
        out.append(inference_pb2.ChatMessage(role=ROLE_ALIASES.get(role, role), content=_content(message, i)))
    return out


def _prompt(body: Mapping) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and len(prompt) > 1:
        raise UnsupportedField("prompt")  # several prompts: one answer each, like n > 1
    if not isinstance(prompt, str):
        raise InvalidField("prompt", "prompt must be a string")
    return prompt


def _stop(body: Mapping) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise InvalidField("stop", "stop must be a string or a list of strings")


def response_schema(value: Any) -> str:
    """Ballast's response_format (JSON Schema text, "" for free text) of OpenAI's."""
    if value is None:
        return ""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidField("response_format", "response_format must be an object with a type")
    kind = value["type"]
    if kind == "text":
        return ""
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidField("response_format.json_schema.schema", "json_schema.schema must be an object")
        return json.dumps(schema)
    raise InvalidField("response_format.type", f"unknown response_format type {kind!r}")


def _tier(body: Mapping, headers: Mapping[str, str]) -> Tier:
    header = headers.get(TIER_HEADER)
    if header is not None:
        tier = HEADER_TIERS.get(header.strip().lower())
        if tier is None:
            raise InvalidField(TIER_HEADER, f"{TIER_HEADER} must be one of S, A, B or AUTO")
        return tier
    service_tier = body.get("service_tier")
    if service_tier is None:
        return Tier.AUTO
    if not isinstance(service_tier, str) or service_tier not in SERVICE_TIERS:
        raise InvalidField("service_tier", f"service_tier must be one of {sorted(SERVICE_TIERS)}")
    return SERVICE_TIERS[service_tier]


def _allow_degraded(headers: Mapping[str, str]) -> bool | None:
    value = headers.get(ALLOW_DEGRADED_HEADER)
    if value is None:
        return None
    flag = value.strip().lower()
    if flag not in ("true", "false"):
        raise InvalidField(ALLOW_DEGRADED_HEADER, f"{ALLOW_DEGRADED_HEADER} must be true or false")
    return flag == "true"


def to_generate_request(
    body: Any, headers: Mapping[str, str], *, chat: bool
) -> tuple[inference_pb2.GenerateRequest, Shape]:
    """The GenerateRequest of an OpenAI body and how to shape its answer. `headers` has
    lower-case names. Raises InvalidField (or UnsupportedField) naming the field."""
    if not isinstance(body, dict):
        raise InvalidField("body", "the body must be a JSON object")
    for name, allowed in UNSUPPORTED_UNLESS.items():
        if name in body and not _neutral(body[name], allowed):
            raise UnsupportedField(name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidField("model", "model must be a non-empty string")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise InvalidField("stream_options", "stream_options must be an object, and only with stream")
    include_usage = _bool(options or {}, "include_usage")
    request = inference_pb2.GenerateRequest(
        model=model,
        tier=tier_to_pb(_tier(body, headers)),
        response_format=response_schema(body.get("response_format")),
        session_id=headers.get(SESSION_HEADER, ""),
    )
    if chat:
        request.conversation.messages.extend(_messages(body))
    else:
        request.prompt = _prompt(body)
    max_tokens = _int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    sampling = request.sampling
    if max_tokens is not None:
        if not 0 < max_tokens < 1 << 31:
            raise InvalidField("max_tokens", "max_tokens must be > 0 and fit 32 bits")
        sampling.max_tokens = max_tokens
    for name in ("temperature", "top_p"):
        value = _number(body, name)
        if value is not None:
            setattr(sampling, name, value)
    seed = _int(body, "seed")
    if seed is not None:
        if not 0 <= seed < 1 << 64:
            raise InvalidField("seed", "seed must be >= 0 and fit 64 bits")
        sampling.seed = seed
    sampling.stop.extend(_stop(body))
    allow_degraded = _allow_degraded(headers)
    if allow_degraded is not None:
        request.allow_degraded = allow_degraded
    return request, Shape(chat=chat, model=model, stream=stream, include_usage=include_usage)
