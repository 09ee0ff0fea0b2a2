"""One request's life on the workers: pick, stream, and resume elsewhere when a worker fails.

The client sees one unbroken stream. When a worker dies, stalls, drains or errors after
some tokens were sent, the request continues on another worker of the same model version
(enforced: during a rollout the version is the one the session drew, see rollout/split.py)
from the prompt plus every token already sent (`generated_ids`), with `max_tokens` reduced:
no token lost, none repeated, indices continuous. Sampling resumes exactly because the
random state at each position derives from the seed and the position (the router gives
unseeded requests a seed derived from their idempotency key). Attempts draw on a retry
budget so a failing pool cannot become a retry storm; worker faults feed the breakers. A
request whose workers die while taking it on is a likely query of death: it costs at most
`router.quarantine.max_workers_lost` workers, then it is quarantined (resilience/quarantine.py).

A run is one `RequestRun` (the request, its tier and deadline, what it has delivered so
far); the runner yields plain events (`services.router.events`), which the gRPC edge turns
into protobuf (`services.router.events_pb`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import AsyncIterator, Protocol

import grpc

from services.common import tracing
from services.common.accepted import was_accepted
from services.router.settings import RouterConfig
from services.common.errors import NoLiveWorker, RetryBudgetExhausted, Unavailable, WorkerLost
from services.common.generation import FinishReason
from services.common.membership import MembershipWatcher, WorkerRecord
from services.common.tier import Tier
from services.router.affinity import SessionAffinity
from services.router.context.window import fit_request_async
from services.router.events import Event, Finished, Resumed, Started, Tokens, WorkerFinished
from services.router.events_pb import worker_request_pb
from services.router.metrics import RouterMetrics
from services.router.model_registry import ModelRegistry
from services.router.pools import PoolGates, slot_key, worker_id_of
from services.router.request_run import RequestRun, StreamState
from services.router.requests import InferenceRequest
from services.router.resilience.breaker import Outcome, Permit
from services.router.resilience.failover import (
    DECIDED_ERRORS,
    DEFAULT_LEASE_QUIET_S,
    Action,
    AttemptFailure,
    FailoverDecision,
    Preempted,
    StreamEndedEarly,
    WorkerLeaseLost,
    WorkerProgress,
    decide,
    worker_died,
)
from services.router.resilience.health_view import WorkerHealthView
from services.router.resilience.quarantine import Implication, RouterQuarantine, incarnation_of
from services.router.resilience.resume import plan_resume
from services.router.resilience.retry_budget import RetryBudget
from services.router.rollout.controller import RolloutController
from services.router.rollout.mirror import Answer, MirrorHandle
from services.router.rollout.split import Role, Route
from services.router.scheduling.async_gate import Grant
from services.router.structured.repair import repair
from services.router.relay_link import RelayCall, engine_moved_at
from services.router.worker_call import WorkerCall
from services.router.worker_clients import WorkerChannels

log = logging.getLogger(__name__)
TRACER = tracing.tracer("router")


def _pool_words(model: str, version: str | None) -> str:
    return f"model {model!r}" + (f" version {version}" if version else "")


class AttemptControl:
    """Lets outside events (preemption, lost lease) end the current worker call cleanly."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.call: grpc.aio.UnaryStreamCall | RelayCall | None = None
        # The latest attempt's call, kept after it ended: did its worker take the request?
        self.last_call: grpc.aio.UnaryStreamCall | RelayCall | None = None
        # Whether that call asked its worker to confirm taking the request on (quarantine).
        self.confirm_asked = False

    def interrupt(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        if self.call is not None:
            self.call.cancel()

    def take(self) -> str | None:
        reason, self.reason = self.reason, None
        return reason


class RunObserver(Protocol):
    """Hears of every request run on a pool (the autoscaler's windows, for one). The times
    count from the moment the run began on the pool."""

    def arrival(self, model: str) -> None: ...

    def ttft(self, model: str, ms: float) -> None: ...

    def e2e(self, model: str, ms: float) -> None: ...


class GenerationRunner:
    def __init__(
        self,
        config: RouterConfig,
        membership: MembershipWatcher,
        clients: WorkerChannels,
        models: ModelRegistry,
        health: WorkerHealthView,
        retry_budget: RetryBudget,
        pools: PoolGates,
        metrics: RouterMetrics,
        rollouts: RolloutController | None = None,
        quarantine: RouterQuarantine | None = None,
        lease_quiet_s: float = DEFAULT_LEASE_QUIET_S,
    ) -> None:
        self.config = config
        self.membership = membership
        self.clients = clients
        self.models = models
        self.health = health
        self.retry_budget = retry_budget
        self.pools = pools
        self.metrics = metrics
        self.affinity = SessionAffinity()
        # Without etcd (a runner built on its own) no rollout is ever seen: plain routing.
        self.rollouts = rollouts or RolloutController(None, clients, models)
        self._observers: list[RunObserver] = []
        # When each worker last relayed a token, for telling a wedged worker from a slow one
        # (with the worker's own word that its engine moved, read from the attempt's call).
        self.progress = WorkerProgress(lease_quiet_s=lease_quiet_s, engine_quiet_s=config.quarantine.engine_quiet_s)
        # Without etcd (a runner built on its own) the quarantine is this router's alone.
        self.quarantine = quarantine or RouterQuarantine(config.quarantine, counter=metrics.quarantine)

    def add_observer(self, observer: RunObserver) -> None:
        """Tells `observer` of each run from now on: its arrival, first token and end."""
        self._observers.append(observer)

    async def run(self, run: RequestRun) -> AsyncIterator[Event]:
        request = run.request
        # Before any worker or budget is touched: a quarantined request costs nothing more.
        self.quarantine.check(request)
        observed_from = time.perf_counter()
        for observer in self._observers:
            observer.arrival(request.model)
        awaiting_token = bool(self._observers)
        run.attempts = self.retry_budget.start()
        route = self.rollouts.route(request)
        mirror = self._mirror(request, route, run.deadline)
        run.state.keep_text = mirror is not None
        error: BaseException | None = None
        try:
            events = self._run_in_pool(run, None) if route is None else self._run_routed(run, route)
            async for event in events:
                if awaiting_token and isinstance(event, Tokens):
                    awaiting_token = False
                    ms = (time.perf_counter() - observed_from) * 1000
                    for observer in self._observers:
                        observer.ttft(request.model, ms)
                yield event
        except BaseException as exc:
            error = exc
            raise
        finally:
            if mirror is not None:
                # Hands the primary's answer to the mirror's comparison; never waits for it.
                mirror.primary_done(self._answer(run, error))
        ms = (time.perf_counter() - observed_from) * 1000
        for observer in self._observers:
            observer.e2e(request.model, ms)

    def _mirror(self, request: InferenceRequest, route: Route | None, deadline: float) -> MirrorHandle | None:
        if route is None or not route.mirror:
            return None
        return self.rollouts.mirror(request, lambda version: self.pools.idle_worker(request.model, version), deadline)

    @staticmethod
    def _answer(run: RequestRun, error: BaseException | None) -> Answer:
        state = run.state
        return Answer(
            list(state.sent_ids),
            "".join(state.text_parts or ()),
            run.ttft_ms(),
            error=None if error is None else type(error).__name__,
        )

    async def _run_routed(self, run: RequestRun, route: Route) -> AsyncIterator[Event]:
        """Runs a request on its rollout version. Only before the first token may it move to
        the other version (the one without workers, or whose workers all failed): after
        that, a resume needs the very same weights."""
        request, state = run.request, run.state
        versions = route.versions()
        for position, version in enumerate(versions):
            last = position == len(versions) - 1
            if not last and not self.pools.has_capacity(request.model, version=version):
                if self.pools.isolated(request.model, version):
                    # Every worker of the version failed so often its breaker shut it out.
                    self.rollouts.observe(request.model, version, False)
                self.rollouts.fell_back(request.model, route)
                continue
            try:
                async for event in self._run_in_pool(run, version):
                    yield event
                return
            except Unavailable as error:
                if last or state.sent_ids:
                    raise
                if isinstance(error, RetryBudgetExhausted) and route.role is not Role.CANDIDATE:
                    raise  # a failing candidate is the trial's cost, not the client's: it always falls back
                log.info(
                    "request %s: version %s failed before its first token (%s); trying %s",
                    request.request_id,
                    version,
                    error,
                    versions[position + 1],
                )
                self.rollouts.fell_back(request.model, route)
                state.model_version = ""  # starts again on the other version, with its tokenizer

    async def _run_in_pool(self, run: RequestRun, version: str | None) -> AsyncIterator[Event]:
        """Runs a request on the model's workers (of `version` only, when given)."""
        request, state, tier = run.request, run.state, run.tier
        stall_s = self.config.stall.timeout_for(tier)
        gate = self.pools.gate(request.model, version)
        if not self.pools.has_capacity(request.model, version=version):
            raise NoLiveWorker(f"no live worker for {_pool_words(request.model, version)}")
        ticket = gate.scheduler.new_ticket(
            request.request_id,
            request.tenant,
            tier,
            weight=run.weight,
            client_deadline=run.deadline,
            prefer=self.pools.key_for(self.affinity.preferred(request.tenant, request.session_id)),
        )
        control = AttemptControl()
        admission = gate.slot(ticket, on_preempt=lambda _grant: control.interrupt("preempted"))
        async with tracing.span_until_entered(
            TRACER, "router.admission", admission, {"ballast.tier": tier, "ballast.pool": request.model}
        ) as grant:
            while True:
                if control.take() == "preempted":
                    await self._pause(grant, state, tier)
                worker = self.membership.get(worker_id_of(grant.worker_id))
                if worker is not None and slot_key(worker) != grant.worker_id:
                    worker = None  # restarted since dispatch: a new incarnation, a new slot
                if worker is not None and state.model_version and worker.model_version != state.model_version:
                    if state.sent_ids:
                        worker = None  # a resume continues on the very same weights only
                    else:
                        state.model_version = ""  # nothing sent yet: start afresh on this version
                permit = self.health.acquire(worker.id) if worker is not None else None
                if worker is None or permit is None:
                    # Gone or breaker-probes busy since dispatch: not an attempt, just another slot.
                    await self._another_slot(grant, request, self._pinned(version, state))
                    continue
                sent_before = len(state.sent_ids)
                control.last_call, control.confirm_asked = None, False
                try:
                    if not state.model_version:
                        yield await self._start(run, worker)
                    async for event in self._attempt(run, worker, stall_s, grant, control):
                        yield event
                    permit.record(Outcome.SUCCESS)
                    self.rollouts.observe(request.model, worker.model_version, True, run.ttft_ms())
                    self.affinity.served(request.tenant, request.session_id, worker.id)
                    return
                except DECIDED_ERRORS as error:
                    silent = self.progress.silent(worker.id, error, engine_moved_at(control.last_call))
                    died = worker_died(error, silent)
                    tokens_this_attempt = len(state.sent_ids) - sent_before
                    # Read before any await: the requests lost with the worker give their
                    # slots up one at a time as they handle the loss. Only a request lost
                    # before its first token can be implicated (and so excused).
                    waiting_ahead = 0
                    if died and tokens_this_attempt == 0:
                        waiting_ahead = grant.waiting_ahead_at_loss(self.progress.last_token_at(worker.id))
                    decision = decide(
                        AttemptFailure(
                            error,
                            worker.id,
                            tokens_sent=len(state.sent_ids),
                            tokens_this_attempt=tokens_this_attempt,
                            accepted=died and await was_accepted(control.last_call),
                            deadline_passed=time.monotonic() >= run.deadline,
                            worker_silent=silent,
                            confirm_asked=control.confirm_asked,
                            queued=self.quarantine.queued(waiting_ahead),
                        ),
                        run.attempts.ask,
                    )
                    async for event in self._apply(decision, run, worker, permit, grant, version):
                        yield event
                finally:
                    permit.release()

    async def _apply(
        self,
        decision: FailoverDecision,
        run: RequestRun,
        worker: WorkerRecord,
        permit: Permit,
        grant: Grant,
        version: str | None,
    ) -> AsyncIterator[Event]:
        """Carries out a failed attempt's decision: the worker's breaker and marks, the
        request's quarantine tally, then a pause, another worker, or the client's error."""
        request, state, tier = run.request, run.state, run.tier
        permit.record(decision.breaker)
        if decision.mark_unreachable:
            self.health.mark_unreachable(worker)
        if decision.rollout_fault:
            self.rollouts.observe(request.model, worker.model_version, False)
        taken_on = decision.implication is Implication.TAKEN_ON
        if decision.implication is not Implication.NONE:
            # Counts against the request: it costs a bounded number of workers (this raises
            # Quarantined at the limit).
            self.quarantine.worker_lost(
                request,
                decision.reason,
                worker.id,
                taken_on=taken_on,
                incarnation=incarnation_of(worker),
                queued=decision.queued,
            )
        if decision.action is Action.FAIL:
            assert decision.error is not None
            raise decision.error from None
        if decision.action is Action.PAUSE:
            await self._pause(grant, state, tier)
            if state.sent_ids:
                yield self._resumed(state, decision.reason)
            return
        self.metrics.worker_attempts.add(1, {"reason": decision.reason})
        log.info(
            "request %s (trace %s): worker %s failed (%s) after %d tokens; trying another",
            request.request_id,
            tracing.trace_id(),
            worker.id,
            decision.reason,
            len(state.sent_ids),
        )
        try:
            await self._another_slot(grant, request, self._pinned(version, state))
        except NoLiveWorker as gone:
            if taken_on:
                # Not "the pool is down" but "the pool went down under this request".
                raise WorkerLost(f"{gone.message}; worker {worker.id} died taking this request on") from None
            raise
        if decision.action is Action.RESUME:
            state.resumes += 1
            self.metrics.resumes.add(1, {"tier": tier, "reason": decision.reason})
            yield self._resumed(state, decision.reason)

    @staticmethod
    def _pinned(version: str | None, state: StreamState) -> str | None:
        """The version the next worker must have: the rollout's, or the one tokens came from."""
        return version or (state.model_version if state.sent_ids else None)

    async def _another_slot(self, grant: Grant, request: InferenceRequest, version: str | None = None) -> None:
        """Queues for another worker (of `version`, when given), unless none is left to wait
        for: then fail fast."""
        avoid = grant.ticket.avoid | {grant.worker_id}
        if not self.pools.has_capacity(request.model, excluding=avoid, version=version):
            raise NoLiveWorker(f"no live worker for {_pool_words(request.model, version)} left to try")
        with TRACER.start_as_current_span("router.admission", attributes={"ballast.admission": "retry"}):
            await grant.retry_elsewhere()

    async def _pause(self, grant: Grant, state: StreamState, tier: Tier) -> None:
        """Gives the slot up after preemption and waits for a new one (the client sees a pause)."""
        self.metrics.preemptions.add(1, {"tier": tier})
        with TRACER.start_as_current_span("router.admission", attributes={"ballast.admission": "preempted"}):
            await grant.resume()
        state.resumes += 1

    @staticmethod
    def _resumed(state: StreamState, why: str) -> Resumed:
        return Resumed(next_index=len(state.sent_ids), reason=why, resumes=state.resumes)

    async def _start(self, run: RequestRun, worker: WorkerRecord) -> Started:
        request, state = run.request, run.state
        tokenizer = await self.models.tokenizer_for(worker, run.deadline - time.monotonic())
        # Fit the conversation into the model's context by the request's policy; done once,
        # so every resume continues the very same prompt.
        _, fit = await fit_request_async(request, tokenizer, policy=request.context_policy, max_turns=request.max_turns)
        state.prompt_ids = list(fit.prompt_ids)
        state.dropped = tuple(fit.dropped)
        self.metrics.context.record(fit, request.model)
        if request.schema is not None or state.keep_text:
            state.text_parts = []
        state.model_version = worker.model_version
        return Started(
            request_id=request.request_id,
            tier=run.tier,
            tier_reason=run.reason,
            model=request.model,
            model_version=worker.model_version,
        )

    async def _watch_lease(self, worker_id: str, control: AttemptControl) -> None:
        gone = self.membership.gone_event(worker_id)
        await gone.wait()
        if gone.draining:
            # A drained worker revokes its lease once its streams are finished or handed back
            # (as Draining errors); the end of one may still be on its way here.
            return
        control.interrupt("lease_lost")

    async def _attempt(
        self,
        run: RequestRun,
        worker: WorkerRecord,
        stall_s: float,
        grant: Grant,
        control: AttemptControl,
    ) -> AsyncIterator[Event]:
        request, state, tier = run.request, run.state, run.tier
        plan = plan_resume(state.prompt_ids, request.sampling, state.sent_ids)
        if plan.nothing_left:
            yield self._finished(run, FinishReason.LENGTH, plan.prompt_tokens, plan.completion_tokens)
            return
        worker_request = worker_request_pb(request, plan, tier, self._flush_interval_ms(request, stall_s))
        relayed = 0
        if control.reason == "preempted":
            control.take()
            raise Preempted()
        attempt = TRACER.start_span(
            "router.worker_attempt",
            attributes={
                "ballast.worker": worker.id,
                "ballast.worker.address": worker.address,
                "ballast.resume_from": len(plan.generated_ids),
                "ballast.resumes": state.resumes,
            },
        )
        finished = False
        # After a failed attempt (every retry and resume is granted through run.attempts; a
        # pause for an S request is not a failure), or for a request that already cost a
        # worker, this attempt's worker confirms taking it on (on Relay; a Generate call
        # cannot): lost before that, it never reached the engine and counts for nothing. Its
        # first token forgives the request's losses (see resilience/quarantine.py).
        suspect = self.quarantine.wants_confirmation(request, follows_failure=run.attempts.attempts > 1)
        control.confirm_asked = suspect and worker.relay
        with WorkerCall(
            self.clients,
            worker.address,
            worker_request,
            run.deadline,
            span=attempt,
            relay=worker.relay,
            confirm_accepted=suspect,
        ) as worker_call:
            control.call = control.last_call = worker_call.call
            # A worker whose lease is gone is dead or cut off: do not wait for a stall.
            lease_watch = asyncio.create_task(self._watch_lease(worker.id, control))
            first_wait = max(stall_s, self.config.first_token_timeout_s)
            try:
                async for event in worker_call.events(stall_s, first_wait):
                    if isinstance(event, Tokens):
                        self.progress.streamed(worker.id)
                        ids = event.token_ids
                        if state.first_token_at is None:
                            state.first_token_at = time.perf_counter()
                            self.metrics.ttft.record(run.ttft_ms(), {"tier": tier})
                        if relayed == 0:
                            grant.first_token()
                            if suspect:
                                self.quarantine.passed(request)
                        # Counted once per attempt (below), not per message: this loop is the hot path.
                        relayed += len(ids)
                        state.sent_ids.extend(ids)
                        if state.text_parts is not None:
                            state.text_parts.append(event.text)
                        yield event
                    elif isinstance(event, WorkerFinished):
                        finished = True
                        yield self._finished(run, event.reason, event.prompt_tokens, len(state.sent_ids))
                        return
            except asyncio.CancelledError:
                # grpc raises CancelledError for a call we cancelled ourselves; only a
                # cancellation of this task (client gone) must propagate as one.
                current = asyncio.current_task()
                if control.reason and current is not None and not current.cancelling():
                    why = control.take()
                    if why == "preempted":
                        raise Preempted() from None
                    raise WorkerLeaseLost(f"worker {worker.id} lost its lease mid-stream") from None
                raise
            finally:
                control.call = None
                lease_watch.cancel()
                tracing.end_span(attempt, sys.exc_info()[1], tokens=relayed, finished=finished)
                if relayed:
                    self.metrics.tokens.add(relayed, {"tier": tier})
                    grant.add_tokens(state.sent_ids[-relayed:])
        raise StreamEndedEarly(f"worker {worker.id} ended the stream without finishing")

    def _flush_interval_ms(self, request: InferenceRequest, stall_s: float) -> int:
        """How long the worker may hold this stream's tokens back (after the first): the
        request's own interval, else the router's default. Half the stall timeout at most: a
        worker holding tokens back must never look stalled."""
        asked = request.flush_interval_ms or self.config.stream_interval_ms
        return min(asked, int(stall_s * 500))

    def _finished(
        self, run: RequestRun, reason: FinishReason | None, prompt_tokens: int, completion_tokens: int
    ) -> Finished:
        request, state = run.request, run.state
        structured = None
        if request.schema is not None:
            # The second net: whatever the engine produced (guided or not, cut by max_tokens),
            # validate it and repair what can be repaired.
            structured = repair("".join(state.text_parts or ()), request.schema)
            self.metrics.structured.record(structured, request.model, request.schema.name)
        return Finished(
            reason=reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            resumes=state.resumes,
            dropped_messages=state.dropped,
            structured=structured,
        )
