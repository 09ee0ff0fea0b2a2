"""Traces across the mesh, in process on port 0: real router, worker (tiny model), cache service
over real Redis, and the backfill service on a real Kafka-protocol broker.

Spans are read from an in-memory exporter added to the process's SDK TracerProvider, the same
provider the services use; each test follows one trace id from a client span of its own. The
OTLP exporter is checked against a collector served on loopback.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from ballast.v1 import common_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.cache.app import create_server as create_cache
from services.cli.client import chat_request, collect
from services.common import tracing
from services.common.config import TracingConfig
from services.common.grpc_server import CHANNEL_OPTIONS, new_server
from services.common.grpc_tracing import client_interceptors
from services.config import load_config
from services.router.app import create_server as create_router
from services.worker.app import create_server as create_worker
from tests.component.conftest import API_KEY, make_config
from tests.component.test_backfill_handoff import read_topic
from tests.component.test_backfill_service import (  # noqa: F401  (fixtures used below)
    backfill_app,
    domain_request,
    hand_off,
    handoff,
    names,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Long enough for two KV blocks of 16 tokens, so the worker looks its prefix up and saves it.
PROMPT = "My order 12345 has not arrived yet; the blue phone case was paid for on Monday. Where is it now?"
TEST_TRACER = trace.get_tracer("tests.tracing")


@pytest.fixture(scope="module")
def spans():
    provider = tracing.install("tests", TracingConfig())
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


@pytest.fixture(scope="module")
def etcd_prefix():
    return f"/ballast-trace-{uuid.uuid4().hex[:8]}/"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cache(redis_server, spans):
    app = await create_cache(
        load_config(
            environ={
                "BALLAST__REDIS__URL": redis_server.url,
                "BALLAST__CACHE__PORT": "0",
                "BALLAST__CACHE__KEY_PREFIX": f"trace-{uuid.uuid4().hex[:8]}:",
                "BALLAST__TELEMETRY__METRICS_PORT": "0",
            }
        )
    )
    yield app
    await app.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def router(etcd_server, tiny_model_dir, etcd_prefix, cache, spans):
    worker = await create_worker(
        make_config(
            etcd_server,
            tiny_model_dir,
            etcd_prefix,
            BALLAST__WORKER__CACHE_ADDRESS=cache.address,
            BALLAST__WORKER__KV_BLOCK_TOKENS="16",
            BALLAST__WORKER__KV_MEMORY_SESSIONS="0",
            BALLAST__WORKER__KV_RESTORE_POLICY="always",
        )
    )
    await worker.registration.registered.wait()
    app = await create_router(make_config(etcd_server, tiny_model_dir, etcd_prefix, BALLAST__ROUTER__HTTP_PORT="0"))
    assert await app.membership.wait_for(lambda workers: worker.worker_id in workers, timeout=10)
    yield app
    await app.shutdown(grace_s=1.0)
    await worker.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(loop_scope="session")
async def traced_stub(router):
    """A client whose channel sends the current span's context, as a traced caller's would."""
    async with grpc.aio.insecure_channel(
        router.address, options=CHANNEL_OPTIONS, interceptors=client_interceptors()
    ) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def turns(router, outcome: str) -> float:
    """The router's `ballast_agent_turns_total` for one outcome (all models)."""
    prefix = "ballast_agent_turns_total{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in router.telemetry.render().splitlines()
        if line.startswith(prefix) and f'outcome="{outcome}"' in line
    )


def of_trace(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


async def wait_for_spans(exporter, trace_id: int, names: set[str], timeout_s: float = 30.0) -> list[ReadableSpan]:
    """Spans of the trace once every one of `names` has ended (KV saves end after the stream)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = of_trace(exporter, trace_id)
        missing = names - {s.name for s in found}
        if not missing:
            return found
        assert time.monotonic() < deadline, (
            f"spans never ended: {sorted(missing)}; have {sorted(s.name for s in found)}; all {[(s.name, hex(s.context.trace_id), s.parent) for s in exporter.get_finished_spans()]}"
        )
        await asyncio.sleep(0.1)


def only(found: list[ReadableSpan], name: str, parent: ReadableSpan | None = None) -> ReadableSpan:
    matches = [s for s in found if s.name == name and (parent is None or s.parent.span_id == parent.context.span_id)]
    assert len(matches) == 1, f"{name} under {parent.name if parent else '-'}: {[(s.name, s.parent) for s in found]}"
    return matches[0]


async def test_one_request_is_one_trace_through_router_worker_and_cache(router, traced_stub, spans):
    succeeded = turns(router, "success")
    with TEST_TRACER.start_as_current_span("client") as client:
        result = await collect(
            traced_stub, chat_request(PROMPT, max_tokens=8, session_id=f"s-{uuid.uuid4().hex}"), API_KEY
        )
    assert result.finished is not None
    assert turns(router, "success") == succeeded + 1
    trace_id = client.get_span_context().trace_id
    found = await wait_for_spans(
        spans,
        trace_id,
        {
            "ballast.v1.Inference/Generate",
            "router.admission",
            "router.worker_attempt",
            "ballast.v1.Worker/Generate",
            "worker.prefill",
            "worker.decode",
            "worker.kv_restore",
            "worker.kv_save",
            "ballast.v1.KVCache/Lookup",
            "ballast.v1.KVCache/Put",
        },
    )

    router_span = only(found, "ballast.v1.Inference/Generate")
    assert router_span.parent.span_id == client.get_span_context().span_id
    assert router_span.parent.is_remote and router_span.kind is SpanKind.SERVER
    assert router_span.attributes["ballast.tier"] in ("S", "A", "B")
    assert router_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    only(found, "router.admission", parent=router_span)
    attempt = only(found, "router.worker_attempt", parent=router_span)
    assert attempt.attributes["ballast.finished"] is True and attempt.attributes["ballast.tokens"] > 0

    worker_span = only(found, "ballast.v1.Worker/Generate", parent=attempt)
    assert worker_span.kind is SpanKind.SERVER and worker_span.parent.is_remote
    prefill = only(found, "worker.prefill", parent=worker_span)
    decode = only(found, "worker.decode", parent=worker_span)
    assert prefill.end_time <= decode.start_time

    restore = only(found, "worker.kv_restore", parent=worker_span)
    only(found, "ballast.v1.KVCache/Lookup", parent=restore)
    save = only(found, "worker.kv_save", parent=worker_span)
    assert save.attributes["ballast.outcome"] == "saved"
    only(found, "ballast.v1.KVCache/Lookup", parent=save)
    put = only(found, "ballast.v1.KVCache/Put", parent=save)
    assert put.attributes["ballast.kv.stored"] >= 1

    # Every span of the request is in the one trace; none ended in error.
    assert {s.context.trace_id for s in found} == {trace_id}
    assert all(s.status.status_code is not StatusCode.ERROR for s in found)


async def test_an_http_request_continues_the_callers_traceparent(router, spans):
    import aiohttp

    with TEST_TRACER.start_as_current_span("http client") as client:
        context = client.get_span_context()
        traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"http://127.0.0.1:{router.http.port}/v1/completions",
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
                headers={"Authorization": f"Bearer {API_KEY}", "traceparent": traceparent},
            ) as reply:
                assert reply.status == 200, await reply.text()
    found = await wait_for_spans(
        spans, context.trace_id, {"POST /v1/completions", "router.worker_attempt", "ballast.v1.Worker/Generate"}
    )
    http_span = only(found, "POST /v1/completions")
    assert http_span.kind is SpanKind.SERVER and http_span.parent.span_id == context.span_id
    assert http_span.attributes["http.response.status_code"] == 200
    attempt = only(found, "router.worker_attempt")
    only(found, "ballast.v1.Worker/Generate", parent=attempt)
    assert {s.context.trace_id for s in found} == {context.trace_id}


async def test_a_request_without_trace_context_starts_its_own_trace(router, spans):
    async with grpc.aio.insecure_channel(router.address, options=CHANNEL_OPTIONS) as channel:
        result = await collect(
            inference_pb2_grpc.InferenceStub(channel),
            chat_request("Hello there", max_tokens=4, request_id="untraced-1"),
            API_KEY,
        )
    assert result.finished is not None
    roots = [
        s
        for s in spans.get_finished_spans()
        if s.name == "ballast.v1.Inference/Generate" and s.attributes.get("ballast.request_id") == "untraced-1"
    ]
    assert len(roots) == 1 and roots[0].parent is None
    worker_spans = await wait_for_spans(spans, roots[0].context.trace_id, {"ballast.v1.Worker/Generate"})
    assert only(worker_spans, "router.worker_attempt").parent.span_id == roots[0].context.span_id


async def test_bad_input_is_recorded_on_the_span_but_is_not_a_server_error(router, traced_stub, spans):
    rejected, succeeded = turns(router, "rejected"), turns(router, "success")
    with TEST_TRACER.start_as_current_span("client") as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await collect(traced_stub, chat_request("hi", model="no-such-model"), API_KEY)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    # Not a turn the service failed: it counts as rejected, outside the success rate.
    assert (turns(router, "rejected"), turns(router, "success")) == (rejected + 1, succeeded)
    found = await wait_for_spans(spans, client.get_span_context().trace_id, {"ballast.v1.Inference/Generate"})
    router_span = only(found, "ballast.v1.Inference/Generate")
    assert router_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert router_span.status.status_code is StatusCode.UNSET
    assert not [s for s in found if s.name == "router.worker_attempt"]


# --- through Kafka ------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def router_app(router):
    """The backfill service of test_backfill_service replays through this module's router."""
    return router


async def test_handoff_carries_the_trace_and_the_backfill_replay_continues_it(
    kafka_broker, handoff, backfill_app, names, spans
):
    request = domain_request("Is the blue phone case back in stock?", session=f"s-{uuid.uuid4().hex}")
    # Stands for the router's span of the request that degraded: the hand-off reads the current one.
    with TEST_TRACER.start_as_current_span("degraded request") as original:
        ticket = await hand_off(handoff, request)
    context = original.get_span_context()

    records = await asyncio.to_thread(read_topic, kafka_broker.bootstrap, names["topic"], 1)
    assert [name for name, _value in records[0].headers()].count("traceparent") == 1
    headers = dict(records[0].headers())
    assert (
        headers["traceparent"].decode()
        == f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    )

    found = await wait_for_spans(
        spans,
        context.trace_id,
        {"backfill.handle", "ballast.v1.Inference/Generate", "ballast.v1.Worker/Generate"},
        timeout_s=90,
    )
    handle = only(found, "backfill.handle")
    assert handle.parent.span_id == context.span_id and handle.parent.is_remote
    assert handle.kind is SpanKind.CONSUMER and handle.attributes["ballast.ticket"] == ticket
    assert handle.attributes["ballast.outcome"] == "stored"
    replay = only(found, "ballast.v1.Inference/Generate", parent=handle)
    attempt = only(found, "router.worker_attempt", parent=replay)
    only(found, "ballast.v1.Worker/Generate", parent=attempt)


# --- export ----------------------------------------------------------------------------------------


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on loopback that keeps what it receives."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_spans_are_exported_to_the_configured_otlp_collector():
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    provider = tracing.build_provider("router", TracingConfig(endpoint=f"127.0.0.1:{port}", export_timeout_s=5))
    try:
        with provider.get_tracer("ballast.router").start_as_current_span("exported") as span:
            span.set_attribute("ballast.request_id", "r-1")
        # The exporter's client is synchronous: flush off the loop that serves the collector.
        assert await asyncio.to_thread(provider.force_flush, 10_000)
    finally:
        await asyncio.to_thread(provider.shutdown)
        await server.stop(grace=None)
    exported = [
        (resource_spans.resource, exported_span)
        for request in collector.requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for exported_span in scope_spans.spans
    ]
    assert [s.name for _, s in exported] == ["exported"]
    resource, exported_span = exported[0]
    assert exported_span.trace_id == span.get_span_context().trace_id.to_bytes(16, "big")
    assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == "ballast-router"


class EndlessWorker(worker_pb2_grpc.WorkerServicer):
    """Streams tokens as fast as the caller takes them, until it goes away; records that its
    cleanup ran. A caller that stops reading leaves the handler waiting in gRPC's send, not in
    its own code: the stream is then closed from outside, by another task."""

    def __init__(self) -> None:
        self.cleaned_up = asyncio.Event()

    async def Generate(self, request, context):
        try:
            i = 0
            while True:
                yield worker_pb2.WorkerGenerateEvent(
                    tokens=common_pb2.Tokens(text="x" * 1000, token_ids=[i], first_index=i)
                )
                i += 1
        finally:
            self.cleaned_up.set()


async def test_a_stream_the_caller_cancels_ends_its_span_without_a_context_error(spans, caplog):
    servicer = EndlessWorker()
    server = new_server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with caplog.at_level(logging.ERROR, logger="opentelemetry.context"):
            for _ in range(5):
                servicer.cleaned_up.clear()
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    call = worker_pb2_grpc.WorkerStub(channel).Generate(
                        worker_pb2.WorkerGenerateRequest(prompt_ids=[1])
                    )
                    async for _event in call:
                        break
                    await asyncio.sleep(0.2)  # the server fills the window and waits to send
                    call.cancel()
                await asyncio.wait_for(servicer.cleaned_up.wait(), 10)
            await asyncio.sleep(0.2)
        # The server closed each stream from another task than the one that ran its steps; the
        # span's context must not have been left attached across them.
        assert not [r for r in caplog.records if "detach" in r.getMessage()]
        # A caller that went away is the caller's outcome, not a server error.
        ended = [s for s in spans.get_finished_spans() if s.name == "ballast.v1.Worker/Generate"]
        assert len(ended) >= 5
        assert {s.attributes["rpc.grpc.status_code"] for s in ended[-5:]} == {grpc.StatusCode.CANCELLED.value[0]}
        assert all(s.status.status_code != StatusCode.ERROR for s in ended[-5:])
    finally:
        await server.stop(None)
