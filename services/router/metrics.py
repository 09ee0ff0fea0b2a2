"""The router's metrics: requests by tier and outcome, latency, tokens relayed, in-flight."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from services.common.telemetry import Telemetry
from services.common.tier import Tier
from services.router.context.metrics import ContextMetrics
from services.router.scheduling.scheduler import SchedulerObserver
from services.router.structured.metrics import StructuredMetrics
from services.router.turns import TurnMetrics

if TYPE_CHECKING:
    from services.router.relay_link import RelayCounts

BREAKER_STATE_VALUE = {"closed": 0, "half_open": 1, "open": 2}
# Hears each queue wait: the pool label (the scheduler's: the model) and the wait in ms.
QueueWaitListener = Callable[[str, float], None]


class RouterMetrics:
    def __init__(self, telemetry: Telemetry) -> None:
        meter = telemetry.meter
        self.requests = meter.create_counter(
            "ballast_router_requests", description="Generate calls by tier, outcome and protocol (grpc, http)."
        )
        self.tokens = meter.create_counter("ballast_router_streamed_tokens", description="Tokens relayed to clients.")
        self.in_flight = meter.create_up_down_counter(
            "ballast_router_in_flight", description="Streams open to clients."
        )
        self.worker_attempts = meter.create_counter(
            "ballast_router_worker_retries",
            description="Requests moved to another worker after a failure, by reason.",
        )
        self.resumes = meter.create_counter(
            "ballast_router_resumes",
            description="Streams resumed mid-way on another worker, by tier and reason.",
        )
        self.quarantine = meter.create_counter(
            "ballast_router_quarantine",
            description="Poison requests: fingerprints quarantined after costing workers (event=quarantined), "
            "requests refused for one (event=refused).",
        )
        self.breaker_transitions = meter.create_counter(
            "ballast_breaker_transitions", description="Circuit-breaker state changes, by new state."
        )
        self.preemptions = meter.create_counter(
            "ballast_router_preemptions", description="Streams paused to free a slot for tier S, by tier."
        )
        self.refusals = meter.create_counter(
            "ballast_router_admission_refused", description="Requests refused at admission, by pool, tier and reason."
        )
        self.expired = meter.create_counter(
            "ballast_router_queue_expired", description="Queued requests that waited past their limit."
        )
        self.queue_wait = telemetry.latency_histogram(
            "ballast_router_queue_wait", "Time a request waited for a worker slot, by pool and tier."
        )
        self._queue_wait_listeners: list[QueueWaitListener] = []
        self.tier_capped = meter.create_counter(
            "ballast_router_tier_capped",
            description="Requests that asked for (or were tagged) a tier above their tenant's grant, by the tier "
            "asked, the tier given and the reason (capped_by_grant).",
        )
        self.rule_hits = meter.create_counter(
            "ballast_router_tiering_rule_hits", description="Auto-tagging rules that decided or weighted a request."
        )
        self.fallbacks = meter.create_counter(
            "ballast_router_fallback_trigger_count", description="Degraded requests by reason and level."
        )
        self.structured = StructuredMetrics(meter)
        self.context = ContextMetrics(meter)
        self.turns = TurnMetrics(meter)
        self._meter = meter
        self.ttft = telemetry.latency_histogram("ballast_router_ttft", "Time from request to first token, by tier.")
        self.e2e = telemetry.latency_histogram(
            "ballast_router_e2e", "Time from request to the finished event, by tier."
        )

    @property
    def meter(self) -> Meter:
        """The router's meter, for components that register instruments of their own."""
        return self._meter

    def add_queue_wait_listener(self, listener: QueueWaitListener) -> None:
        """Calls `listener(pool, ms)` with every queue wait recorded from now on."""
        self._queue_wait_listeners.append(listener)

    def record_queue_wait(self, pool: str, tier: Tier, ms: float) -> None:
        self.queue_wait.record(ms, {"pool": pool, "tier": tier})
        for listener in self._queue_wait_listeners:
            listener(pool, ms)

    def observe_breakers(self, snapshot: Callable[[], Mapping[str, object]]) -> None:
        """Exports each worker's breaker state: 0 closed, 1 half-open, 2 open."""

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            for worker_id, snap in snapshot().items():
                yield Observation(BREAKER_STATE_VALUE.get(snap.state.value, 0), {"worker": worker_id})

        self._meter.create_observable_gauge(
            "ballast_breaker_state",
            callbacks=[observe],
            description="Circuit-breaker state per worker: 0 closed, 1 half-open, 2 open.",
        )

    def observe_relay(self, counts: "RelayCounts") -> None:
        """Exports what the Relay streams to workers carried: messages each way, events in."""

        def messages(_options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(counts.messages_in, {"direction": "from_workers"})
            yield Observation(counts.messages_out, {"direction": "to_workers"})

        def events(_options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(counts.events_in)

        self.meter.create_observable_counter(
            "ballast_router_relay_messages",
            callbacks=[messages],
            description="Messages on the Relay streams to workers, by direction (each carries several requests').",
        )
        self.meter.create_observable_counter(
            "ballast_router_relay_events",
            callbacks=[events],
            description="Worker events (tokens, ends, accepts, errors) received on Relay streams.",
        )

    def observe_routing(self, snapshot: Callable[[], Mapping[str, object]]) -> None:
        """Exports whether each worker takes new requests: 1 routable, 0 not, labelled with
        the reason it is out ("none" while routable), so a hot or draining worker shows."""

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            for worker_id, health in snapshot().items():
                reason = health.reason.value if health.reason is not None else "none"
                yield Observation(1 if health.routable else 0, {"worker": worker_id, "reason": reason})

        def temperature(_options: CallbackOptions) -> Iterable[Observation]:
            for worker_id, health in snapshot().items():
                if health.temperature_c is not None:
                    yield Observation(health.temperature_c, {"worker": worker_id})

        self._meter.create_observable_gauge(
            "ballast_router_worker_routable",
            callbacks=[observe],
            description="Whether the router sends a worker new requests (1) or not (0), and why not.",
        )
        self._meter.create_observable_gauge(
            "ballast_router_worker_temperature_celsius",
            callbacks=[temperature],
            unit="Cel",
            description="The GPU temperature each worker last published, as the router routes by it.",
        )

    def observe_queues(self, snapshots: Callable[[], Mapping[str, object]]) -> None:
        """Exports queued and running requests per pool and tier from scheduler snapshots."""

        def queued(_options: CallbackOptions) -> Iterable[Observation]:
            for pool, snap in snapshots().items():
                for tier, tier_snap in snap.tiers.items():
                    yield Observation(tier_snap.queued, {"pool": pool, "tier": tier})

        def running(_options: CallbackOptions) -> Iterable[Observation]:
            for pool, snap in snapshots().items():
                for tier, tier_snap in snap.tiers.items():
                    yield Observation(tier_snap.running, {"pool": pool, "tier": tier})

        self._meter.create_observable_gauge(
            "ballast_router_queue_length", callbacks=[queued], description="Requests waiting for a slot."
        )
        self._meter.create_observable_gauge(
            "ballast_router_running", callbacks=[running], description="Requests holding a worker slot."
        )


class SchedulerMetrics(SchedulerObserver):
    """Feeds the scheduler's events into the router's OpenTelemetry instruments."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def queue_wait(self, pool: str, tier: Tier, seconds: float) -> None:
        self.metrics.record_queue_wait(pool, tier, seconds * 1000)

    def refused(self, pool: str, tier: Tier, reason: str) -> None:
        self.metrics.refusals.add(1, {"pool": pool, "tier": tier, "reason": reason})

    def expired(self, pool: str, tier: Tier) -> None:
        self.metrics.expired.add(1, {"pool": pool, "tier": tier})

    def preempted(self, pool: str, tier: Tier) -> None:
        pass  # counted by the runner, which sees the pause itself
