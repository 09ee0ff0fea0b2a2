"""The soak's two kinds of client, each as its users would write it.

- Baseline: the official OpenAI SDK against plain OpenAI-compatible servers behind a
  round-robin balancer (client side, as an httpx transport: each request, and each of the
  SDK's own retries, goes to the next server in rotation; a server leaves the rotation when
  its health check fails, as behind a Kubernetes Service with a readiness probe). The SDK's
  own retry behaviour: up to two retries on connection errors and 408/409/429/5xx before the
  first byte, none mid-stream. JSON turns use `response_format` (json_schema).
- Ballast: gRPC stubs on a channel balanced over every router (`round_robin`), tier and
  session set, JSON turns with `response_format`; a stream cut by a lost router is retried
  with the same `request_id` (the README's advice: the same key gives the same tokens), and
  tokens the client already has are not shown twice.

Both take a `TurnPlan` and the conversation so far and give back a `RequestSample` (what the
client saw) and the answer's text (which becomes the next turn's context). A JSON answer is
judged here with `jsonschema`, not by the server's own verdict.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable

import grpc
import httpx
import jsonschema
import openai

from ballast.v1 import common_pb2, inference_pb2
from bench.soak.table import JSON_FAILED, JSON_REPAIRED, JSON_VALID, RequestSample
from bench.soak.traffic import TurnPlan
from services.common.tier_pb import TIER_TO_PB

REQUEST_TIMEOUT_S = 60.0
BALLAST_ATTEMPTS = 3
# A cut stream is retried on these: the router (or the connection to it) went away.
RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


# The longest failed JSON answer a sample keeps.
FAILED_JSON_CHARS = 400


def record_json(sample: RequestSample, text: str, schema: dict | None, repaired_document: str = "") -> None:
    """Judges a finished answer against its schema into the sample, keeping a failure's text."""
    sample.json_outcome = json_outcome(text, schema, repaired_document)
    if sample.json_outcome == JSON_FAILED:
        sample.failed_json = (repaired_document or text)[:FAILED_JSON_CHARS]


def json_outcome(text: str, schema: dict | None, repaired_document: str = "") -> str:
    """How a JSON answer fares against its schema: valid as streamed, repaired (the server's
    repaired document validates), or failed. "" for a free-text turn."""
    if schema is None:
        return ""
    if _validates(text, schema):
        return JSON_VALID
    if repaired_document and _validates(repaired_document, schema):
        return JSON_REPAIRED
    return JSON_FAILED


def _validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# -- baseline --------------------------------------------------------------------------------


class RoundRobinTransport(httpx.AsyncBaseTransport):
    """Sends each request to the next backend port in rotation (a client-side balancer)."""

    def __init__(self) -> None:
        self._ports: list[int] = []
        self._next = 0
        self._inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=2000, max_keepalive_connections=500))

    @property
    def ports(self) -> list[int]:
        return list(self._ports)

    def set_ports(self, ports: list[int]) -> None:
        self._ports = list(ports)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        ports = self._ports
        if not ports:
            raise httpx.ConnectError("no server in rotation", request=request)
        port = ports[self._next % len(ports)]
        self._next += 1
        request.url = request.url.copy_with(host="127.0.0.1", port=port)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def openai_client(transport: RoundRobinTransport) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=transport, timeout=REQUEST_TIMEOUT_S)
    # The SDK's defaults: two retries with backoff, on connection errors and retryable statuses.
    return openai.AsyncOpenAI(base_url="http://balanced/v1", api_key="none", http_client=http, max_retries=2)


def _response_format(turn: TurnPlan) -> dict | openai.NotGiven:
    if turn.schema is None:
        return openai.NOT_GIVEN
    return {"type": "json_schema", "json_schema": {"name": turn.schema_name, "schema": turn.schema}}


async def baseline_turn(
    client: openai.AsyncOpenAI,
    model: str,
    session: str,
    turn: TurnPlan,
    messages: list[dict],
    clock: Callable[[], float],
) -> tuple[RequestSample, str]:
    sample = RequestSample(session=session, turn=turn.index, tier=turn.tier, start=clock(), end=0.0, ok=False)
    text = ""
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=turn.max_tokens,
            temperature=1.0,
            seed=turn.seed,
            stream=True,
            stream_options={"include_usage": True},
            response_format=_response_format(turn),
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if sample.ttft is None:
                    sample.ttft = clock() - sample.start
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                sample.tokens = chunk.usage.completion_tokens
        sample.ok = True
    except (openai.APIError, httpx.HTTPError) as exc:
        sample.error = type(exc).__name__
        sample.cut = bool(text)
    sample.end = clock()
    if sample.ok:
        record_json(sample, text, turn.schema)
    return sample, text


# -- Ballast -----------------------------------------------------------------------------------


def balanced_channel(addresses: list[str]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel("ipv4:" + ",".join(addresses), options=[("grpc.lb_policy_name", "round_robin")])


def ballast_request(model: str, session: str, turn: TurnPlan, messages: list[dict]) -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest(
        request_id=f"{session}-{turn.index}-{uuid.uuid4().hex[:8]}",
        session_id=session,
        model=model,
        sampling=common_pb2.SamplingParams(max_tokens=turn.max_tokens, temperature=1.0, seed=turn.seed),
        tier=TIER_TO_PB[turn.tier],
        response_format=turn.schema_text,
    )
    for message in messages:
        request.conversation.messages.add(role=message["role"], content=message["content"])
    return request


async def ballast_turn(
    stub, metadata, model: str, session: str, turn: TurnPlan, messages: list[dict], clock: Callable[[], float]
) -> tuple[RequestSample, str]:
    sample = RequestSample(session=session, turn=turn.index, tier=turn.tier, start=clock(), end=0.0, ok=False)
    request = ballast_request(model, session, turn, messages)
    pieces: dict[int, str] = {}  # first token index of an event -> its text
    received = 0
    finished = None
    for attempt in range(BALLAST_ATTEMPTS):
        # A retried stream starts again from token 0 with the same tokens: its text is
        # taken whole, and what the client already showed is not shown again.
        pieces.clear()
        try:
            call = stub.Generate(request, metadata=metadata, timeout=REQUEST_TIMEOUT_S)
            async for event in call:
                kind = event.WhichOneof("event")
                if kind == "tokens":
                    tokens = event.tokens
                    pieces[tokens.first_index] = tokens.text
                    if sample.ttft is None:
                        sample.ttft = clock() - sample.start
                    received = max(received, tokens.first_index + len(tokens.token_ids))
                elif kind == "finished":
                    finished = event.finished
            break
        except grpc.aio.AioRpcError as exc:
            sample.error = exc.code().name
            if exc.code() not in RETRIED_CODES or attempt == BALLAST_ATTEMPTS - 1:
                break
            sample.resumes += 1
    text = "".join(pieces[i] for i in sorted(pieces))
    sample.end = clock()
    if finished is not None:
        sample.ok, sample.error = True, ""
        sample.tokens = finished.usage.completion_tokens
        sample.resumes += finished.resumes
        sample.degraded = finished.degradation != common_pb2.DEGRADATION_NONE
        record_json(sample, text, turn.schema, finished.structured_output)
    else:
        sample.cut = received > 0
    return sample, text


def monotonic_since(origin: float) -> Callable[[], float]:
    return lambda: time.monotonic() - origin
