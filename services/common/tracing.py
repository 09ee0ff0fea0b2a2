"""Distributed traces: the process's TracerProvider and W3C trace context in Kafka headers.

Spans are always created and their context always propagates (router -> worker -> cache over
gRPC metadata, see grpc_tracing.py; router -> backfill through Kafka record headers), so one
trace id ties a request together even where nothing is exported. An OTLP/gRPC exporter is
added only when `telemetry.tracing.endpoint` is set. Spans record (attributes, events, timing)
only while the provider has a span processor to read them: without one, every span is a
non-recording one that still carries and passes on its trace id. A recorded span costs tens
of microseconds, and a request makes several in each process it crosses. The provider is the
OpenTelemetry global: one per process, set up by the first service configured in it; later
ones reuse it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, AsyncContextManager, AsyncIterator, Iterable, Mapping, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:  # config imports modules that trace (the degrade hand-off)
    from services.common.config import TracingConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

# W3C trace context only (traceparent, tracestate): what every OpenTelemetry SDK reads, whatever
# OTEL_PROPAGATORS says in this process.
PROPAGATOR = TraceContextTextMapPropagator()
TRACEPARENT = "traceparent"

_install_lock = threading.Lock()


def install(service: str, config: TracingConfig) -> TracerProvider:
    """The process's SDK TracerProvider, created (with an exporter when configured) on first use."""
    with _install_lock:
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            return current
        provider = build_provider(service, config)
        trace.set_tracer_provider(provider)
        return provider


class _RecordWhenRead(Sampler):
    """Drops every span until a span processor is added; then samples as `inner` says."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.read = False

    def should_sample(
        self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None
    ) -> SamplingResult:
        sampler = self.inner if self.read else ALWAYS_OFF
        return sampler.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"RecordWhenRead{{{self.inner.get_description()}}}"


class _Provider(TracerProvider):
    """A TracerProvider whose spans record only once something reads them."""

    def __init__(self, sampler: _RecordWhenRead, resource: Resource) -> None:
        super().__init__(sampler=sampler, resource=resource)
        self._gate = sampler

    def add_span_processor(self, span_processor) -> None:
        super().add_span_processor(span_processor)
        self._gate.read = True


def build_provider(service: str, config: TracingConfig) -> TracerProvider:
    """A TracerProvider as `config` says: sampled at the root by ratio, then by the caller's
    choice; nothing records until a span processor (the exporter, when configured) is added."""
    provider = _Provider(
        _RecordWhenRead(ParentBased(TraceIdRatioBased(config.sample_ratio))),
        resource=Resource.create({"service.name": f"ballast-{service}"}),
    )
    if config.endpoint:
        provider.add_span_processor(BatchSpanProcessor(otlp_exporter(config)))
        log.info("exporting traces to %s (sample ratio %.3g)", config.endpoint, config.sample_ratio)
    return provider


def otlp_exporter(config: TracingConfig):
    # Imported here: a process that exports nothing never loads the OTLP protobufs.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.endpoint, insecure=config.insecure, timeout=config.export_timeout_s)


def flush(timeout_s: float = 5.0) -> None:
    """Exports what is buffered (a stopping service); the provider itself lives until exit."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush(int(timeout_s * 1000))


def tracer(component: str) -> Tracer:
    """The tracer of one Ballast component ("router", "worker", ...); resolves the provider lazily."""
    return trace.get_tracer(f"ballast.{component}")


def trace_id(span: Span | None = None) -> str:
    """The current (or given) span's trace id in hex, for logs; "" outside any trace."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def end_span(span: Span, error: BaseException | None = None, **attributes) -> None:
    """Ends `span` once, marking it failed when `error` is a real failure (not a cancellation)."""
    if not span.is_recording():
        return
    for key, value in attributes.items():
        span.set_attribute(f"ballast.{key}", value)
    if error is not None and not isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


@asynccontextmanager
async def span_until_entered(
    tracer_: Tracer, name: str, manager: AsyncContextManager[T], attributes: Mapping | None = None
) -> AsyncIterator[T]:
    """Enters `manager` (a wait for a slot, a lock) under a span that ends once it is entered.

    The span measures only the wait; the body that follows is not part of it.
    """
    async with AsyncExitStack() as stack:
        span = tracer_.start_span(name, attributes=dict(attributes or {}))
        try:
            value = await stack.enter_async_context(manager)
        except BaseException as error:
            end_span(span, error)
            raise
        end_span(span)
        yield value


# --- Kafka record headers -----------------------------------------------------------------


def context_headers(ctx: otel_context.Context | None = None) -> list[tuple[str, bytes]]:
    """The trace context of `ctx` (default: the current one) as Kafka headers; [] outside a trace."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=ctx)
    return [(key, value.encode()) for key, value in carrier.items()]


def context_from_headers(headers: Iterable[tuple[str, bytes | str | None]]) -> otel_context.Context:
    """The trace context carried by Kafka headers (an empty context when there is none)."""
    carrier: dict[str, str] = {}
    for key, value in headers:
        if value is not None and key.lower() in PROPAGATOR.fields:
            carrier[key.lower()] = value.decode(errors="replace") if isinstance(value, bytes) else value
    return PROPAGATOR.extract(carrier, context=otel_context.Context())


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | Mapping | None) -> otel_context.Context:
    """The trace context in gRPC metadata (keys are lower case on the wire)."""
    pairs = metadata.items() if isinstance(metadata, Mapping) else (metadata or ())
    return context_from_headers(pairs)
