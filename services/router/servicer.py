"""`ballast.v1.Inference`: authenticate, validate, classify, then hand the request to the runner.

The runner yields plain events and the degradation ladder relays and marks them; here, at the
edge, each becomes a `GenerateEvent` message once (`events_pb`), for the client. `generate` is that whole
request path; the gRPC `Generate` and the OpenAI-compatible HTTP front (`router.openai`) both
call it, so authentication, validation, tiers, admission, failover and degradation are one code.

The client's deadline bounds everything downstream: each worker call gets the time that is
left. When the client goes away, the worker call is cancelled, which aborts generation on
the worker and frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import AsyncIterator, Iterable, Protocol

import grpc
from opentelemetry import trace

from ballast.v1 import inference_pb2, inference_pb2_grpc
from services.common.auth import Authenticator, Caller
from services.common.entitlements import cap_tier
from services.common.errors import BallastError, NotFound, QuotaExceeded, Unavailable
from services.common.membership import MembershipWatcher
from services.common.tier import Tier
from services.config import BallastConfig
from services.router.backfill_proxy import BackfillProxy
from services.router.context.guard import ContextGuard
from services.router.context.live_eval import publish_retention
from services.router.degrade.degrader import Degrader
from services.router.events import Event, Finished, Started, Tokens
from services.router.events_pb import event_to_pb
from services.router.generation import GenerationRunner
from services.router.metrics import RouterMetrics, SchedulerMetrics
from services.router.model_registry import ModelRegistry
from services.router.pools import PoolGates
from services.router.quotas import Reservation, TenantQuotas
from services.router.request_run import RequestRun
from services.router.requests import InferenceRequest, checked_request
from services.router.resilience.breaker import BreakerBoard
from services.router.resilience.failover import lease_quiet_s
from services.router.resilience.health_view import WorkerHealthView
from services.router.resilience.retry_budget import RetryBudget
from services.router.resilience.temperature import TemperatureGate
from services.router.rollout.controller import RolloutController
from services.router.routing_view import RoutingViewPublisher
from services.router.scheduling.tagging import RuleError, TagInput, TierClassifier, default_rules, load_rules
from services.router.scheduling.tiers import TierPolicy
from services.router.structured.repair import Status
from services.router.turns import classify_turn
from services.router.worker_clients import WorkerClients

log = logging.getLogger(__name__)


class CallInfo(Protocol):
    """What the request path needs of a call, whatever its protocol: a gRPC servicer context
    has both methods, the HTTP front adapts its request to them."""

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...

    def time_remaining(self) -> float | None: ...


def _outcome(error: BaseException) -> str:
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    if isinstance(error, QuotaExceeded):
        return "quota_exceeded"
    if isinstance(error, BallastError):
        return error.code.name.lower()
    return "internal"


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self,
        config: BallastConfig,
        membership: MembershipWatcher,
        clients: WorkerClients,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.router_config = config.router
        self.quotas = TenantQuotas(config.router.quotas)
        self.membership = membership
        self.clients = clients
        self.metrics = metrics
        self.auth = Authenticator(config.auth)
        self.models = ModelRegistry(
            clients,
            config.router.worker_connect_timeout_s,
            on_new_version=lambda tokenizer: publish_retention(tokenizer, metrics.context),
        )
        self.health = WorkerHealthView(
            BreakerBoard(config.router.breaker, on_transition=self._breaker_changed),
            TemperatureGate(config.router.temperature),
            unreachable_hold_s=config.router.unreachable_hold_s,
        )
        self.retry_budget = RetryBudget(config.router.retry)
        self.pools = PoolGates(
            TierPolicy.from_mapping(config.router.scheduling), membership, self.health, SchedulerMetrics(metrics)
        )
        self.context_guard = ContextGuard(self.models.latest, self.pools.has_capacity)
        # Rollouts follow etcd; the app starts and stops the controller.
        self.rollouts = RolloutController(config.etcd, clients, self.models, metrics.meter)
        self.runner = GenerationRunner(
            config.router,
            membership,
            clients,
            self.models,
            self.health,
            self.retry_budget,
            self.pools,
            metrics,
            rollouts=self.rollouts,
            lease_quiet_s=lease_quiet_s(config.etcd.lease_ttl_s, config.etcd.heartbeat_s),
        )
        self.classifier = TierClassifier(
            self._initial_rules(config.router.tiering_rules_file),
            on_hit=lambda rule: metrics.rule_hits.add(1, {"rule": rule}),
        )
        self.degrader = Degrader(
            config.degrade,
            config.kafka.bootstrap,
            kafka_security=config.kafka.security_properties(),
            encoder_for=self._encoder_for,
            on_fallback=lambda labels: metrics.fallbacks.add(1, labels),
        )
        self.degrader.register_metrics(metrics.meter)
        # Subscribe and GetBackfill relay to the backfill service; the app starts and closes it.
        self.backfill: BackfillProxy | None = None
        # The gauges read a view the event loop publishes: scrapes run on another thread.
        self.routing_view = RoutingViewPublisher(
            membership, self.health, lambda: {m: g.scheduler.snapshot() for m, g in self.pools.gates().items()}
        )
        metrics.observe_breakers(lambda: self.routing_view.current.breakers())
        metrics.observe_routing(lambda: self.routing_view.current.workers)
        metrics.observe_relay(clients.relay_counts)
        metrics.observe_queues(lambda: self.routing_view.current.queues)

    def _encoder_for(self, model: str):
        """The tokenizer of a model whose version this router already knows, else None."""
        for worker in self.membership.workers().values():
            if worker.model == model:
                known = self.models.cached(worker.model_version)
                if known is not None:
                    return known.tokenizer
        return None

    @staticmethod
    def _initial_rules(path: str):
        return load_rules(Path(path).read_text()) if path else default_rules()

    def rules_changed(self, value: bytes | None) -> None:
        """New auto-tagging rules from etcd; a bad document is logged and the old rules stay."""
        if value is None:
            self.classifier.update(self._initial_rules(self.config.router.tiering_rules_file))
            log.info("tiering rules removed from etcd: back to the configured rules")
            return
        try:
            self.classifier.update_from_text(value)
        except RuleError as exc:
            log.error("ignoring invalid tiering rules from etcd: %s", exc)
            return
        log.info("tiering rules updated from etcd")

    def _breaker_changed(self, worker_id: str, old, new) -> None:
        log.warning("breaker of worker %s: %s -> %s", worker_id, old.value, new.value)
        self.metrics.breaker_transitions.add(1, {"to": new.value})

    def _check_model_known(self, model: str) -> None:
        if model in self.router_config.models:
            return
        if any(w.model == model for w in self.membership.workers().values()):
            return
        raise NotFound(f"unknown model {model!r}; this router serves {sorted(self.router_config.models)}")

    def _deadline(self, call: CallInfo) -> float:
        remaining = call.time_remaining()
        budget = self.router_config.default_deadline_s
        if remaining is not None:
            budget = min(budget, remaining)
        return time.monotonic() + budget

    def _tier(self, request: InferenceRequest, caller: Caller) -> tuple[Tier, str, float]:
        """Tier, the reason for it (rule name, "explicit", or why the caller's grant changed it)
        and the scheduling weight. The grant is applied last: neither the client nor a tagging
        rule lifts a request above what its tenant may claim."""
        asked = Tier(request.tier)
        if asked is Tier.AUTO:
            decided = self.classifier.classify(TagInput.from_request(request))
            tier, reason, weight = decided.tier, decided.rule, decided.weight
        else:
            tier, reason, weight = asked, "explicit", 1.0
        granted, why = cap_tier(tier, caller.tiers)
        if why is None:
            return tier, reason, weight
        self.metrics.tier_capped.add(1, {"asked": tier, "tier": granted, "reason": why})
        return granted, why, weight

    def _used_tokens(
        self, reservation: Reservation, finished: Finished | None, generated: int, reached_worker: bool
    ) -> int:
        """What a stream cost its tenant: the answer's usage when it finished; else (cancelled,
        failed) the prompt's estimate and the tokens relayed, or nothing if no worker saw it."""
        if finished is not None:
            return finished.prompt_tokens + finished.completion_tokens
        if not reached_worker and not generated:
            return 0
        return reservation.prompt_estimate + generated

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateEvent]:
        async with contextlib.aclosing(self.generate(request, context, "grpc")) as events:
            async for event in events:
                yield event

    async def generate(
        self, request: inference_pb2.GenerateRequest, call: CallInfo, protocol: str
    ) -> AsyncIterator[inference_pb2.GenerateEvent]:
        """The request path every edge shares (gRPC `Generate`, the OpenAI-compatible HTTP
        front): authenticate, validate, classify, run with degradation. `call` gives the
        caller's metadata and remaining time; `protocol` labels the request metrics.
        Closing the stream cancels the request on its worker at once."""
        started = time.perf_counter()
        # The tier label of the request metrics, "unknown" until the request has one.
        tier_label = "unknown"
        outcome = "ok"
        model = ""
        failure: BaseException | None = None
        finished: Finished | None = None
        reservation: Reservation | None = None
        generated = 0
        reached_worker = False
        self.metrics.in_flight.add(1)
        try:
            # A backfill replay runs as the tenant whose request degraded: its quota, its share.
            caller = self.auth.caller(call.invocation_metadata())
            tenant = caller.tenant
            inference = await checked_request(request, tenant, self.router_config)
            self._check_model_known(inference.model)
            model = inference.model
            # Before the ladder: a prompt over the model's context is bad input whether or not
            # a worker is alive, never a degraded answer.
            await self.context_guard.check(inference)
            # After validation, so a malformed request costs the tenant nothing.
            reservation = self.quotas.admit(tenant, inference.prompt_chars, inference.sampling.max_tokens)
            tier, reason, weight = self._tier(inference, caller)
            tier_label = tier
            # The Started event has no field for it: the trace is found by request id instead.
            trace.get_current_span().set_attributes(
                {"ballast.request_id": inference.request_id, "ballast.tier": tier, "ballast.model": model}
            )
            deadline = self._deadline(call)

            def pool_stream(request: InferenceRequest) -> AsyncIterator[Event]:
                return self.runner.run(RequestRun(request, tier, reason, weight, deadline, started))

            # The ladder runs the primary pool first; on admission refusal, no live worker,
            # a spent retry budget or a deadline it cannot meet, it degrades (if allowed).
            async for event in self.degrader.run(
                pool_stream, inference, tier=tier, tier_reason=reason, deadline=deadline, started=started
            ):
                if isinstance(event, Tokens):
                    # Counted here, so a stream that ends without a Finished event is still charged.
                    generated += len(event.token_ids)
                elif isinstance(event, Started):
                    reached_worker = True
                elif isinstance(event, Finished):
                    finished = event
                yield event_to_pb(event)
        except BaseException as error:
            outcome = _outcome(error)
            failure = error
            raise
        finally:
            if reservation is not None:
                self.quotas.settle(reservation, self._used_tokens(reservation, finished, generated, reached_worker))
            self.metrics.in_flight.add(-1)
            self.metrics.requests.add(1, {"tier": tier_label, "outcome": outcome, "protocol": protocol})
            remaining = call.time_remaining()
            self.metrics.turns.record(
                classify_turn(
                    failure,
                    finished is not None,
                    finished is not None
                    and finished.structured is not None
                    and finished.structured.status is Status.FAILED,
                    deadline_passed=remaining is not None and remaining <= 0,
                ),
                model,
            )
            if outcome == "ok":
                self.metrics.e2e.record((time.perf_counter() - started) * 1000, {"tier": tier_label})

    async def Subscribe(self, request, context: grpc.aio.ServicerContext):
        async for answer in self._backfill().subscribe(request, context):
            yield answer

    async def GetBackfill(self, request, context: grpc.aio.ServicerContext):
        return await self._backfill().get(request, context)

    def _backfill(self) -> BackfillProxy:
        if self.backfill is None:
            raise Unavailable("this router has no backfill service to relay to")
        return self.backfill
