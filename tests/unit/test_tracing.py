"""Tracing helpers without a network: trace context in Kafka headers, sampling, span lifetimes,
and the tracing section of the config."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from services.common import tracing
from services.common.grpc_tracing import trace_metadata, unary_client_interceptors
from services.common.config import ConfigError, TracingConfig
from services.config import load_config


@pytest.fixture
def recorded():
    """A provider of its own (not the process's), and what it recorded."""
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("tests"), exporter
    provider.shutdown()


def test_kafka_headers_round_trip_the_current_span(recorded):
    tracer, _ = recorded
    with tracer.start_as_current_span("request") as span:
        headers = tracing.context_headers()
    assert [name for name, _ in headers] == ["traceparent"]
    restored = trace.get_current_span(tracing.context_from_headers([("content-type", b"x"), *headers]))
    assert restored.get_span_context().trace_id == span.get_span_context().trace_id
    assert restored.get_span_context().span_id == span.get_span_context().span_id
    assert restored.get_span_context().is_remote


def test_no_trace_means_no_headers_and_bad_headers_mean_a_new_trace():
    assert tracing.context_headers(otel_context.Context()) == []
    for headers in ([], [("traceparent", b"not-a-trace")], [("traceparent", None)]):
        context = tracing.context_from_headers(headers)
        assert not trace.get_current_span(context).get_span_context().is_valid


def test_grpc_metadata_carries_the_same_context(recorded):
    tracer, _ = recorded
    with tracer.start_as_current_span("request") as span:
        metadata = [(name, value.decode()) for name, value in tracing.context_headers()]
    context = tracing.context_from_metadata([("x-api-key", "k"), *metadata])
    assert trace.get_current_span(context).get_span_context().span_id == span.get_span_context().span_id
    assert tracing.trace_id(span) == f"{span.get_span_context().trace_id:032x}"
    assert tracing.trace_id(trace.INVALID_SPAN) == ""


def test_call_metadata_for_streams_carries_the_current_span_and_nothing_without_one(recorded):
    tracer, _ = recorded
    assert trace_metadata() == ()
    with tracer.start_as_current_span("attempt") as span:
        metadata = trace_metadata()
    assert [name for name, _ in metadata] == ["traceparent"]
    context = tracing.context_from_metadata(metadata)
    assert trace.get_current_span(context).get_span_context().span_id == span.get_span_context().span_id


def test_worker_channels_leave_streaming_calls_to_the_caller():
    shapes = {type(i).__bases__[0] for i in unary_client_interceptors()}
    assert grpc.aio.UnaryStreamClientInterceptor not in shapes
    assert grpc.aio.StreamStreamClientInterceptor not in shapes
    assert {grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.StreamUnaryClientInterceptor} <= shapes


def test_sampling_ratio_zero_records_nothing_new_but_ids_still_propagate():
    provider = tracing.build_provider("tests", TracingConfig(sample_ratio=0.0))
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracer = provider.get_tracer("tests")
    with tracer.start_as_current_span("root") as root:
        assert not root.is_recording()
        headers = tracing.context_headers()
    assert root.get_span_context().is_valid and headers  # a trace id for the logs and the next hop
    # A caller that sampled its trace is followed, whatever this process's ratio.
    sampled = TracerProvider().get_tracer("caller").start_span("caller")
    with tracer.start_as_current_span("child", context=trace.set_span_in_context(sampled)) as child:
        assert child.is_recording()
    provider.shutdown()


def test_span_until_entered_measures_the_wait_only(recorded):
    tracer, exporter = recorded
    events: list[str] = []

    @asynccontextmanager
    async def slot():
        await asyncio.sleep(0.01)
        events.append("entered")
        yield "grant"
        events.append("left")

    async def run():
        async with tracing.span_until_entered(tracer, "admission", slot(), {"tier": "A"}) as grant:
            assert grant == "grant"
            assert [s.name for s in exporter.get_finished_spans()] == ["admission"]  # ended at entry
            events.append("body")

    asyncio.run(run())
    assert events == ["entered", "body", "left"]
    (span,) = exporter.get_finished_spans()
    assert span.attributes["tier"] == "A" and span.status.status_code is StatusCode.UNSET


def test_span_until_entered_marks_a_refused_entry_as_an_error(recorded):
    tracer, exporter = recorded

    @asynccontextmanager
    async def refused():
        raise RuntimeError("queue full")
        yield

    async def run():
        async with tracing.span_until_entered(tracer, "admission", refused()):
            pass

    with pytest.raises(RuntimeError):
        asyncio.run(run())
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and "queue full" in span.status.description


def test_end_span_ends_once_and_a_cancellation_is_not_an_error(recorded):
    tracer, exporter = recorded
    span = tracer.start_span("attempt")
    tracing.end_span(span, asyncio.CancelledError(), tokens=3)
    tracing.end_span(span, RuntimeError("late"))  # already ended: ignored
    (finished,) = exporter.get_finished_spans()
    assert finished.status.status_code is StatusCode.UNSET and finished.attributes["ballast.tokens"] == 3
    failed = tracer.start_span("attempt")
    tracing.end_span(failed, ConnectionError("worker gone"))
    assert exporter.get_finished_spans()[-1].status.status_code is StatusCode.ERROR


@pytest.mark.parametrize("endpoint", ["collector", "collector:port", "http://collector"])
def test_a_bad_collector_endpoint_fails_naming_the_field(endpoint):
    with pytest.raises(ConfigError, match="telemetry.tracing.endpoint"):
        load_config(environ={"BALLAST__TELEMETRY__TRACING__ENDPOINT": endpoint})


def test_tracing_config_from_the_environment():
    config = load_config(
        environ={
            "BALLAST__TELEMETRY__TRACING__ENDPOINT": "http://otel:4317",
            "BALLAST__TELEMETRY__TRACING__SAMPLE_RATIO": "0.25",
        }
    )
    assert config.telemetry.tracing.endpoint == "http://otel:4317"
    assert config.telemetry.tracing.sample_ratio == 0.25
    with pytest.raises(ConfigError, match="sample_ratio"):
        load_config(environ={"BALLAST__TELEMETRY__TRACING__SAMPLE_RATIO": "1.5"})
    assert load_config(environ={}).telemetry.tracing.endpoint == ""  # off by default


def test_spans_record_only_once_something_reads_them():
    provider = tracing.build_provider("tests", TracingConfig())
    tracer = provider.get_tracer("tests")
    sampled = TracerProvider().get_tracer("caller").start_span("caller")
    with tracer.start_as_current_span("unread", context=trace.set_span_in_context(sampled)) as unread:
        assert not unread.is_recording()  # not even for a caller that sampled its trace
        headers = tracing.context_headers()
    assert unread.get_span_context().trace_id == sampled.get_span_context().trace_id and headers
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with tracer.start_as_current_span("read") as read:
        assert read.is_recording()
    assert [span.name for span in exporter.get_finished_spans()] == ["read"]
    provider.shutdown()
