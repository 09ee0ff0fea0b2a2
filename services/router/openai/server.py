"""The HTTP listener of the OpenAI-compatible front, in the router process.

Built on aiohttp rather than starlette + uvicorn: on loopback, a JSON round trip cost a median
of about 70 us with aiohttp against 80-115 us, and an 11-event SSE stream about 120 us against
200-250 us; aiohttp also cancels a handler the moment its client disconnects
(`handler_cancellation`), which is exactly what frees a worker slot at once, streamed or not.

Every completion runs on `InferenceServicer.generate`, the gRPC path itself; this module only
reads HTTP, shapes the answer (`responses`) and writes errors in OpenAI's shape (`errors`).
Streams (a completion, a session's backfilled answers at
`GET /v1/ballast/sessions/{session_id}/backfill`) are relayed by `sse.SseRelay`: a stream's 200
is held back until its first event, so refusals before it (429 with Retry-After, 503, 400...)
get their own status; after it, an error is a `data: {"error"}` event and `data: [DONE]`;
`: keep-alive` comments every `router.http_keepalive_s` while no event comes. A `traceparent`
header is continued in a server span.

Slow clients are bounded (`flow`): a connection gets `router.http_header_timeout_s` for each
request's headers (aiohttp's keep-alive timer, which also runs from the moment a connection
opens), a body gets `router.http_body_timeout_s` (then 408), and a stream whose client stops
reading waits for it with bounded buffers, then is cancelled after `router.http_stalled_client_s`.
With TLS on the router's public port (`tls.public_tls`), this port is HTTPS with the same
certificates, and plaintext is refused there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from ballast.v1 import backfill_answers_pb2, inference_pb2
from services.common.errors import BallastError
from services.common.tracing import context_from_headers, tracer
from services.router.openai.backfill import answer_json
from services.router.openai.errors import BodyTooLarge, HttpRefusal, RouteNotFound
from services.router.openai.flow import BodyTimeout, ClientStalled, FlowStats, StreamFlow
from services.router.openai.mapping import Shape, check_headers, parse_json, to_generate_request
from services.router.openai.responses import Answer, degraded_headers
from services.router.openai.sse import SseRelay, error_response, sse_event
from services.router.openai.tls import https_context
from services.router.servicer import InferenceServicer
from services.router.structured.limits import check_chat_body

log = logging.getLogger(__name__)

_TRACER = tracer("http")
# Events a stream may run ahead of a slow client.
STREAM_BUFFER = 64
# How long the rest of an unread body is read (and dropped) after an early answer, so the
# client sees the answer rather than a reset; then the connection closes.
LINGER_S = 2.0


class HttpCall:
    """What the request path needs of a call (see servicer.CallInfo), read from HTTP headers.
    HTTP has no deadline header: the router's default deadline applies."""

    def __init__(self, request: web.Request) -> None:
        self._metadata = [(name.lower(), value) for name, value in request.headers.items()]
        # Before anything encodes one (gRPC metadata, protobuf): 400, not a 500 later.
        check_headers(self._metadata)

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None


def _refusal_of(error: web.HTTPException) -> HttpRefusal:
    if isinstance(error, web.HTTPRequestEntityTooLarge):
        return BodyTooLarge("the request body is too large")
    refusal = RouteNotFound(f"no such endpoint: {error.reason}")
    refusal.status = error.status
    return refusal


class OpenAIFront:
    """The aiohttp application and its listener."""

    def __init__(self, servicer: InferenceServicer) -> None:
        self.servicer = servicer
        self.config = servicer.router_config
        self.keepalive_s = self.config.http_keepalive_s
        self.app = web.Application(client_max_size=self.config.http_max_body_bytes, middlewares=[self._middleware])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/ballast/backfill/{ticket}", self.backfill)
        # No HEAD: it would open a subscription (claiming the session's answers) nobody reads.
        self.app.router.add_get(
            "/v1/ballast/sessions/{session_id}/backfill", self.backfill_subscription, allow_head=False
        )
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.flow = FlowStats()
        self.flow.register(servicer.metrics.meter)
        # HTTPS exactly when the public gRPC port has TLS (a plaintext connection then fails
        # its handshake): one public surface, one certificate.
        self.ssl_context = https_context(servicer.config.tls)
        self.scheme = "https" if self.ssl_context is not None else "http"

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0 picks one); returns the port."""
        # keepalive_timeout is aiohttp's only header timer: it runs from when a connection
        # opens or its last answer ended until a whole request's headers are in.
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self.config.shutdown_grace_s,
            keepalive_timeout=self.config.http_header_timeout_s,
            lingering_time=LINGER_S,
        )
        await self._runner.setup()
        # The processes of one router (router.processes) listen on the same port.
        site = web.TCPSite(
            self._runner, host, port, ssl_context=self.ssl_context, reuse_port=self.config.processes > 1 or None
        )
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        """Stops listening; open requests get router.shutdown_grace_s to finish."""
        if self._runner is not None:
            await self._runner.cleanup()

    # -- middleware: tracing and errors ---------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        parent = context_from_headers(request.headers.items())
        route = request.match_info.route.resource
        name = f"{request.method} {route.canonical if route is not None else request.path}"
        span = _TRACER.start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.path},
        )
        token = otel_context.attach(set_span_in_context(span, parent))
        status = 500
        try:
            try:
                response = await handler(request)
            except web.HTTPException as error:
                if error.status < 400:
                    raise
                response = error_response(_refusal_of(error))
            except ClientStalled:
                # Dropped like a client that left: the same path frees the worker slot.
                status = 499
                raise asyncio.CancelledError from None
            except (BallastError, HttpRefusal) as error:
                response = error_response(error)
                if isinstance(error, BodyTimeout):
                    response.force_close()
            except Exception:
                log.exception("bug in %s", name)
                response = error_response(RuntimeError())
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            span.set_attribute("http.response.status_code", status)
            if status >= 500 and status != 503:
                span.set_status(Status(StatusCode.ERROR, str(status)))
            otel_context.detach(token)
            span.end()

    # -- endpoints ------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def models(self, request: web.Request) -> web.Response:
        self.servicer.auth.tenant_for(HttpCall(request).invocation_metadata())
        names = set(self.config.models) | {w.model for w in self.servicer.membership.workers().values()}
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "ballast"} for name in sorted(names)]
        return web.json_response({"object": "list", "data": data})

    async def backfill(self, request: web.Request) -> web.Response:
        call = HttpCall(request)
        answer = await self.servicer.GetBackfill(
            backfill_answers_pb2.GetAnswerRequest(ticket=request.match_info["ticket"]), call
        )
        return web.json_response(answer_json(answer))

    async def backfill_subscription(self, request: web.Request) -> web.StreamResponse:
        """An SSE stream of a session's better answers as the backfill completes them (each
        ticket reaches one subscription once), until the client leaves or
        router.backfill_subscribe_max_s passes; then `data: [DONE]`."""
        call = HttpCall(request)
        self.servicer.auth.tenant_for(call.invocation_metadata())
        subscription = backfill_answers_pb2.SubscribeRequest(session_id=request.match_info["session_id"])
        answers = self.servicer.Subscribe(subscription, call)
        # One answer in hand at a time: an answer the backfill counts as pushed waits in no
        # buffer a leaving client would drop (it stays readable by ticket either way).
        relay = SseRelay(
            request, answers, self.keepalive_s, 1, name="http-backfill-subscription", flow=self._flow(request)
        )
        try:
            while (answer := await relay.next()) is not None:
                await relay.write(sse_event(answer_json(answer)))
            return await relay.finish()
        finally:
            await relay.close()

    def _flow(self, request: web.Request) -> StreamFlow:
        return StreamFlow(request, self.flow, self.config.http_stalled_client_s, self.config.http_stream_buffer_bytes)

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.http_max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BodyTooLarge(f"the request body is {request.content_length} bytes; the limit is {limit}")
        timeout_s = self.config.http_body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge(f"the request body is over {limit} bytes") from None
        except TimeoutError:
            raise BodyTimeout(f"the request body did not arrive within {timeout_s:g}s") from None

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        call = HttpCall(request)
        # Authentication comes first, as on gRPC: a bad key is 401 whatever the body.
        self.servicer.auth.tenant_for(call.invocation_metadata())
        raw = await self._read_body(request)

        def parse() -> tuple[inference_pb2.GenerateRequest, Shape]:
            if chat and len(raw) >= 64 * 1024:
                check_chat_body(raw, self.config.limits)  # 10^5 messages refused before they are built
            # aiohttp's headers are case-insensitive: the mapping's lower-case names find them.
            return to_generate_request(parse_json(raw), request.headers, chat=chat)

        # A big body is parsed and mapped on a thread: a few MB of JSON take longer to walk
        # than the event loop (every other stream, /v1/models, health) may wait.
        generate_request, shape = await asyncio.to_thread(parse) if len(raw) >= 64 * 1024 else parse()
        events = self.servicer.generate(generate_request, call, "http")
        if shape.stream:
            return await self._stream(request, shape, events)
        return await self._whole(shape, events)

    async def _whole(self, shape: Shape, events: AsyncIterator[inference_pb2.GenerateEvent]) -> web.Response:
        answer = Answer(shape)
        async with contextlib.aclosing(events):
            async for event in events:
                answer.feed(event)
        headers = degraded_headers(answer.finished) if answer.finished is not None else {}
        return web.json_response(answer.response(), headers=headers)

    async def _stream(
        self, request: web.Request, shape: Shape, events: AsyncIterator[inference_pb2.GenerateEvent]
    ) -> web.StreamResponse:
        answer = Answer(shape)

        async def first_chunk(response: web.StreamResponse) -> None:
            first = answer.first_chunk()
            if first is not None:
                await response.write(sse_event(first))

        relay = SseRelay(
            request,
            events,
            self.keepalive_s,
            STREAM_BUFFER,
            on_open=first_chunk,
            name="http-stream",
            flow=self._flow(request),
        )
        try:
            while (event := await relay.next()) is not None:
                text = answer.feed(event)
                if relay.response is None and event.WhichOneof("event") != "started":
                    await relay.open()
                if text:
                    await relay.write(sse_event(answer.text_chunk(text)))
            return await relay.finish(answer.final_chunks() if relay.error is None else ())
        finally:
            await relay.close()
