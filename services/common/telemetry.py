"""Metrics for every service: an OpenTelemetry MeterProvider exported on a Prometheus endpoint;
and the process's tracing (see tracing.py).

Each service gets its own meter provider and registry (not the process-global ones), so tests
can run several services in one process and still read each one's /metrics apart. Traces use
the process-global TracerProvider: a span's parent may belong to another service.
"""

from __future__ import annotations

import threading
from typing import Iterable

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from services.common import tracing
from services.common.config import TelemetryConfig
from services.common.grpc_server import malformed_requests
from services.common.loop_lag import LoopLagMonitor

# Latency buckets in milliseconds: fine below 10 ms (relay overhead), coarse up to a minute.
LATENCY_BUCKETS_MS = (
    0.5,
    1,
    2,
    5,
    10,
    25,
    50,
    100,
    250,
    500,
    800,
    1000,
    2000,
    5000,
    15000,
    30000,
    60000,
)


# The worst event-loop lag is reported over this window (ballast_event_loop_lag_worst_ms), and
# a lag worth a warning is logged at most once in it.
LOOP_LAG_WINDOW_S = 60.0


class DependencyStatus:
    """Tracks which dependencies (etcd, Redis, Kafka, peers) a service can reach right now.

    Exported as the gauge `ballast_dependency_up{dependency=...}` and read by health checks,
    so a service always says what it is missing.
    """

    def __init__(self) -> None:
        self._up: dict[str, bool] = {}
        self._lock = threading.Lock()

    def set(self, dependency: str, up: bool) -> None:
        with self._lock:
            self._up[dependency] = up

    def is_up(self, dependency: str) -> bool:
        with self._lock:
            return self._up.get(dependency, False)

    def missing(self) -> list[str]:
        with self._lock:
            return sorted(name for name, up in self._up.items() if not up)

    def snapshot(self) -> dict[str, bool]:
        with self._lock:
            return dict(self._up)

    def observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        for name, up in self.snapshot().items():
            yield Observation(1 if up else 0, {"dependency": name})


class Telemetry:
    """One service's meter, its Prometheus registry and the HTTP endpoint serving it."""

    def __init__(self, service: str, config: TelemetryConfig) -> None:
        self.service = service
        self.config = config
        self.registry = CollectorRegistry(auto_describe=True)
        self._reader = PrometheusMetricReader(
            registry=self.registry, disable_target_info=True, scope_info_enabled=False
        )
        self.provider = MeterProvider(
            metric_readers=[self._reader],
            resource=Resource.create({"service.name": f"ballast-{service}"}),
            # The Prometheus endpoint does not carry exemplars: sampling them on every
            # measurement (the SDK's default, trace-based) would be work on the hot path for nothing.
            exemplar_filter=AlwaysOffExemplarFilter(),
        )
        self.meter = self.provider.get_meter(f"ballast.{service}")
        self.dependencies = DependencyStatus()
        self.meter.create_observable_gauge(
            "ballast_dependency_up",
            callbacks=[self.dependencies.observe],
            description="1 when the service can reach the dependency, else 0.",
        )
        self.meter.create_observable_counter(
            "ballast_grpc_malformed_requests",
            callbacks=[lambda _options: [Observation(malformed_requests())]],
            description="Request frames refused with INVALID_ARGUMENT because they did not parse.",
        )
        self._http = None
        self.port = 0
        self.tracer_provider = tracing.install(service, config.tracing)
        self.loop_lag = LoopLagMonitor(
            self.meter,
            self.latency_histogram(
                "ballast_event_loop_lag", "How late the event loop ran a timer that was due (starved loop)."
            ),
            interval_s=config.loop_lag_interval_s,
            window_s=LOOP_LAG_WINDOW_S,
            warn_ms=config.loop_lag_warn_ms,
        )

    def latency_histogram(self, name: str, description: str):
        return self.meter.create_histogram(
            name,
            unit="ms",
            description=description,
            explicit_bucket_boundaries_advisory=list(LATENCY_BUCKETS_MS),
        )

    def start(self) -> int:
        """Serves /metrics and, called on the service's event loop, starts measuring its lag;
        returns the port (useful when the config asks for port 0)."""
        try:
            self.loop_lag.start()
        except RuntimeError:
            pass  # no running loop (a service driven synchronously, in tests): nothing to measure
        if not self.config.enabled or self._http is not None:
            return self.port
        self._http, _thread = start_http_server(
            self.config.metrics_port, addr=self.config.metrics_host, registry=self.registry
        )
        self.port = self._http.server_port
        return self.port

    def render(self) -> str:
        """The text a Prometheus scrape would get."""
        return generate_latest(self.registry).decode()

    def stop(self) -> None:
        self.loop_lag.stop()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.provider.shutdown()
        tracing.flush()
