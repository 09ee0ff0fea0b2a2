"""One engine behind an OpenAI-compatible HTTP API, and nothing of the mesh: the baseline
server of the soak benchmark for the torch and sim engines.

The soak benchmark compares Ballast with plain serving: N OpenAI-compatible servers behind a
round-robin balancer. With vLLM those are `vllm serve` processes; the torch engine (a small
Llama on CPU) and the sim engine (a timing model that sleeps) have no such server, so this is
their stand-in. It serves one engine (`services.worker.app.make_engine`) the way `vllm serve`
does as far as a client can see, and has no etcd, router, tiers, failover, KV persistence or
admission control: past `--max-concurrency` the engine itself queues requests, as vLLM does.

    python -m bench.plain_server --engine sim --model-dir .ballast/models/tiny --port 8001

Once it serves, it prints one line, `READY port=<port>` (`--port 0` picks a free port, named
there); SIGTERM or SIGINT stops it (exit 0).

Endpoints: `POST /v1/chat/completions` (streamed or not, `response_format` json_schema or
json_object for guided decoding), `GET /v1/models`, `GET /health`, and `GET /metrics`
(Prometheus: `plain_requests_running`, `plain_requests_waiting`, `plain_kv_used_ratio`, and
`plain_kv_fragmentation_ratio` where the engine reports it).

Requests are read, checked and tokenized by the same code as Ballast's own OpenAI front
(`services.router.openai.mapping`, `services.router.requests`, `services.router.tokenization`),
so both sides of the comparison accept the same bodies and generate the same prompt tokens;
only the serving path differs. Like Ballast, a request without `max_tokens` gets the router's
default (vLLM would use the rest of the context), and fields Ballast does not serve (`n` > 1,
tools, logprobs...) are refused by name.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import AsyncIterator, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bench.common import SIM_PROFILE
from services.common.errors import BallastError, NotFound
from services.common.generation import FinishReason
from services.common.lifecycle import catch_stop_signals, settle_startup_garbage, setup_logging
from services.config import BallastConfig
from services.router.openai.errors import BodyTooLarge, HttpRefusal, error_reply
from services.router.openai.mapping import parse_json, to_generate_request
from services.router.openai.sse import DONE, SSE_HEADERS, error_response, sse_event
from services.router.requests import InferenceRequest, request_from_pb
from services.router.settings import RouterConfig
from services.router.tokenization import ModelTokenizer
from services.worker.__main__ import tune_process
from services.worker.app import make_engine
from services.worker.engine import Engine, EngineRequest, EngineStats, ModelDescription, TokenDelta
from services.worker.settings import WorkerConfig

log = logging.getLogger("bench.plain_server")

# A request without max_tokens generates as many as on Ballast's router.
DEFAULT_MAX_TOKENS = RouterConfig.model_fields["default_max_tokens"].default
# Open streams get this long to end when the server stops; then they are cut.
SHUTDOWN_GRACE_S = 5.0
# Longest the engine may take to stop before the process exits anyway.
ENGINE_STOP_TIMEOUT_S = 15.0
# No answer is read: the client left (nginx's convention, as on Ballast's front).
CLIENT_GONE = 499
# Ballast's priority of tier A: every request here is equal, so any one value serves.
PRIORITY = 1


@dataclass(frozen=True)
class ServerSettings:
    engine: str
    model_dir: Path
    model_name: str
    host: str = "127.0.0.1"
    port: int = 0
    max_concurrency: int = 8
    sim_profile: str = ""

    def ballast_config(self) -> BallastConfig:
        """The config `make_engine` reads: only the worker section matters."""
        worker = WorkerConfig(
            engine=self.engine,
            model_dir=str(self.model_dir),
            model_name=self.model_name,
            max_concurrency=self.max_concurrency,
            sim_profile=self.sim_profile,
        )
        return BallastConfig(worker=worker)


def model_tokenizer(model: ModelDescription) -> ModelTokenizer:
    """The router's tokenizer and chat template for `model`. ModelTokenizer reads a worker's
    ModelInfo; a ModelDescription holds the same fields, with the version under another name."""
    info = SimpleNamespace(
        model_version=model.version,
        max_context=model.max_context,
        tokenizer_json=model.tokenizer_json,
        chat_template=model.chat_template,
        bos_token=model.bos_token,
        eos_token=model.eos_token,
    )
    return ModelTokenizer.from_model_info(info)


def request_limits(max_context: int) -> RouterConfig:
    """The router's request checks, with max_tokens bounded only by the model's context."""
    return RouterConfig(default_max_tokens=min(DEFAULT_MAX_TOKENS, max_context), max_tokens_limit=max_context)


def finish_reason(reason: FinishReason | None) -> str:
    """OpenAI's finish_reason; a cancelled stream is never answered, so it reads as a stop."""
    return "length" if reason is FinishReason.LENGTH else "stop"


@dataclass
class Completion:
    """One chat completion as the engine's deltas arrive, in OpenAI's shapes."""

    id: str
    model: str
    prompt_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))
    parts: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    finish: FinishReason | None = None

    def feed(self, delta: TokenDelta) -> None:
        self.parts.append(delta.text)
        self.completion_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish = delta.finish_reason

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def response(self) -> dict:
        message = {"role": "assistant", "content": "".join(self.parts)}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(self.finish)}
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }

    def chunk(self, delta: dict, finish: FinishReason | None = None) -> dict:
        reason = finish_reason(finish) if finish is not None else None
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}])

    def usage_chunk(self) -> dict:
        return {**self._chunk([]), "usage": self.usage()}

    def _chunk(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


class EngineCollector:
    """Prometheus gauges read from the engine's stats at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self):
        stats = self._stats()
        yield GaugeMetricFamily("plain_requests_running", "Sequences the engine is generating.", value=stats.running)
        yield GaugeMetricFamily(
            "plain_requests_waiting", "Requests queued in the engine for a slot.", value=stats.waiting
        )
        yield GaugeMetricFamily("plain_kv_used_ratio", "Share of the KV cache in use.", value=stats.kv_used)
        fragmentation = stats.extra.get("kv_fragmentation")
        if fragmentation is not None:
            yield GaugeMetricFamily(
                "plain_kv_fragmentation_ratio", "Share of allocated KV blocks left unused.", value=fragmentation
            )


class PlainServer:
    """The aiohttp application around one started engine."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = model_tokenizer(engine.model)
        self.limits = request_limits(engine.model.max_context)
        self.serving = False
        self.metrics = CollectorRegistry(auto_describe=False)
        self.metrics.register(EngineCollector(engine.stats))
        self.app = web.Application(client_max_size=self.limits.http_max_body_bytes, middlewares=[self._errors])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.prometheus)
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0 picks one); returns the port."""
        # handler_cancellation: a client that leaves cancels its handler, which closes the
        # engine's stream and frees its slot at once.
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, shutdown_timeout=SHUTDOWN_GRACE_S)
        await site.start()
        self.serving = True
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        self.serving = False
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (BallastError, HttpRefusal) as error:
            return error_response(error)
        except web.HTTPException:
            raise
        except Exception as error:
            log.exception("bug in %s %s", request.method, request.path)
            return error_response(error)

    # -- endpoints ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok" if self.serving else "stopping", status=200 if self.serving else 503)

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": self.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "plain",
                "max_model_len": self.engine.model.max_context,
            }
        ]
        return web.json_response({"object": "list", "data": data})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_json(await self._read_body(request))
        generate_request, shape = to_generate_request(body, {}, chat=True)
        if shape.model != self.model_name:
            raise NotFound(f"the model {shape.model!r} does not exist; this server serves {self.model_name!r}")
        engine_request = self._engine_request(request_from_pb(generate_request, "", self.limits))
        # The engine checks the request here, before anything starts: bad input is a 400.
        deltas = self.engine.generate(engine_request)
        completion = Completion(
            id=f"chatcmpl-{engine_request.request_id}",
            model=self.model_name,
            prompt_tokens=len(engine_request.prompt_ids),
        )
        if shape.stream:
            return await self._stream(request, deltas, completion, shape.include_usage)
        return await self._whole(deltas, completion)

    # -- completions ----------------------------------------------------------------------------

    async def _read_body(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge(f"the request body is over {self.limits.http_max_body_bytes} bytes") from None

    def _engine_request(self, chat: InferenceRequest) -> EngineRequest:
        prompt_ids = self.tokenizer.encode(chat)
        self.tokenizer.check_fits(len(prompt_ids), chat.sampling.max_tokens)
        return EngineRequest(
            request_id=chat.request_id,
            prompt_ids=tuple(prompt_ids),
            generated_ids=(),
            sampling=chat.sampling,
            response_format=chat.response_format,
            priority=PRIORITY,
        )

    async def _whole(self, deltas: AsyncIterator[TokenDelta], completion: Completion) -> web.Response:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                completion.feed(delta)
        return web.json_response(completion.response())

    async def _stream(
        self, request: web.Request, deltas: AsyncIterator[TokenDelta], completion: Completion, include_usage: bool
    ) -> web.StreamResponse:
        """Server-sent events. The 200 waits for the engine's first delta (as vLLM's role chunk
        does), so an engine that fails before it still answers with its own status."""
        response: web.StreamResponse | None = None
        try:
            # Closing the engine's stream (the client left, or an error) aborts its request there.
            async with contextlib.aclosing(deltas):
                try:
                    async for delta in deltas:
                        if response is None:
                            response = await self._open_stream(request, completion)
                        completion.feed(delta)
                        if delta.text or delta.finish_reason is not None:
                            chunk = completion.chunk({"content": delta.text}, delta.finish_reason)
                            await response.write(sse_event(chunk))
                except BallastError as error:
                    if response is None:
                        return error_response(error)
                    log.warning("stream %s failed: %s", completion.id, error)
                    await response.write(sse_event(error_reply(error).body))
            if response is None:  # an engine stream without deltas; never the case, but answer anyway
                response = await self._open_stream(request, completion)
            if include_usage:
                await response.write(sse_event(completion.usage_chunk()))
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:
            # The client left between two writes (rather than while the handler awaited the
            # engine, which cancels it): nobody reads an answer any more.
            log.debug("the client of %s left mid-stream", completion.id)
        return response or web.Response(status=CLIENT_GONE)

    async def _open_stream(self, request: web.Request, completion: Completion) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        await response.write(sse_event(completion.chunk({"role": "assistant", "content": ""})))
        return response


# -- process ----------------------------------------------------------------------------------


async def serve(settings: ServerSettings) -> None:
    config = settings.ballast_config()
    # The same process settings as a Ballast worker of this engine, so the comparison is fair.
    tune_process(config)
    engine = make_engine(config)
    await engine.start()
    server = PlainServer(engine, settings.model_name)
    try:
        port = await server.start(settings.host, settings.port)
        settle_startup_garbage()
        stop = catch_stop_signals()
        print(f"READY port={port}", flush=True)
        signal_name = await stop
        log.info("%s received, stopping", signal_name)
    finally:
        await server.stop()
        try:
            await asyncio.wait_for(engine.stop(), ENGINE_STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("the engine did not stop within %.0fs; exiting anyway", ENGINE_STOP_TIMEOUT_S)


def parse_args(argv: list[str] | None = None) -> ServerSettings:
    parser = argparse.ArgumentParser(prog="python -m bench.plain_server", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("torch", "sim"), required=True)
    parser.add_argument("--model-dir", type=Path, required=True, help="Hugging Face model folder.")
    parser.add_argument("--port", type=int, required=True, help="Port to listen on; 0 picks one.")
    parser.add_argument("--host", default="127.0.0.1", help="Bind address.")
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=8,
        help="Sequences the engine generates at once; more wait in the engine.",
    )
    # The sim benchmarks' profile by default, so a baseline sim server times tokens as Ballast's
    # sim workers in the same benchmark do.
    parser.add_argument(
        "--sim-profile", type=Path, default=SIM_PROFILE, help="sim engine: JSON timing profile (default: %(default)s)."
    )
    parser.add_argument("--model-name", default="", help="Model name clients ask for (default: the folder's name).")
    args = parser.parse_args(argv)
    if args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if args.engine == "sim" and not args.sim_profile.is_file():
        parser.error(f"--sim-profile: no such file: {args.sim_profile}")
    return ServerSettings(
        engine=args.engine,
        model_dir=args.model_dir,
        model_name=args.model_name or args.model_dir.resolve().name,
        host=args.host,
        port=args.port,
        max_concurrency=args.max_concurrency,
        sim_profile=str(args.sim_profile.resolve()) if args.engine == "sim" else "",
    )


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    setup_logging("plain-server")
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
