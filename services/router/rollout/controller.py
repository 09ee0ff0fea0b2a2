"""The router's side of rollouts: follows the etcd documents, routes by them, feeds the SLO
gate and writes its decisions back.

Every router watches `<prefix>rollout/` and routes by what it reads, so an operator's change
or the gate's decision reaches all of them within one watch event. Every router measures the
candidate on the requests it saw (canary attempts and mirrored copies), but only the holder
of the `rollout-gate` leader lock acts on its gate: it writes a promotion or rollback with a
compare-and-swap on the document's mod revision, so neither a router that lost the lock a
moment ago nor an operator's simultaneous change can be overwritten. The watch, the lock and
the writes share the router's `EtcdSession`, handed over at `start()`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import Callable

from opentelemetry.metrics import Meter, NoOpMeter

from services.common.config import EtcdConfig
from services.common.etcd_session import EtcdSession
from services.common.leader import LeaderLock
from services.common.membership import ETCD_ERRORS, WorkerRecord
from services.common.tasks import stop_task
from services.router.model_registry import ModelRegistry
from services.router.requests import InferenceRequest
from services.router.rollout.gate import GateReading, SloGate, Verdict
from services.router.rollout.metrics import RolloutMetrics
from services.router.rollout.mirror import BusinessScore, Comparison, MirrorHandle, MirrorRunner
from services.router.rollout.split import Route, choose
from services.router.rollout.state import Phase, Rollout, RolloutError, load_rollout
from services.router.rollout.store import RolloutStore, store_over
from services.router.rollout.watch import RolloutWatch
from services.router.worker_clients import WorkerChannels

log = logging.getLogger(__name__)

TICK_S = 0.5
LEADER_LOCK = "rollout-gate"
VERDICT_PHASE = {Verdict.PROMOTE: Phase.PROMOTED, Verdict.ROLLBACK: Phase.ROLLED_BACK}


class RolloutController:
    def __init__(
        self,
        etcd: EtcdConfig | None,
        clients: WorkerChannels,
        models: ModelRegistry,
        meter: Meter | None = None,
        business_score: BusinessScore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # None: no etcd, so no rollouts (a runner built without one).
        self.etcd = etcd
        self.metrics = RolloutMetrics(meter or NoOpMeter("ballast.rollout"))
        self.clock = clock
        self.rollouts: dict[str, Rollout] = {}
        self._gates: dict[str, SloGate] = {}
        self._deciding: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        # The document watch, the gate's lock and the session under them: built by start(),
        # over the session it is given (the router's, built by its app).
        self._watch: RolloutWatch | None = None
        self.leader: LeaderLock | None = None
        self.session: EtcdSession | None = None
        self._owns_session = False
        self._identity = f"router-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.mirrors = MirrorRunner(
            clients,
            models,
            on_comparison=self._compared,
            on_outcome=lambda model, outcome: self.metrics.mirrors.add(1, {"model": model, "outcome": outcome}),
            business_score=business_score,
        )

    # ----- documents ------------------------------------------------------------------

    def apply(self, model: str, raw: bytes | None) -> None:
        """A model's document changed in etcd; an invalid one is logged and ignored."""
        if raw is None:
            if self.rollouts.pop(model, None) is not None:
                log.info("rollout of %s removed", model)
            self._gates.pop(model, None)
            return
        try:
            rollout = load_rollout(raw, model)
        except RolloutError as exc:
            self.metrics.rejected.add(1, {"model": model})
            log.error("ignoring invalid rollout document of %s (keeping the previous one): %s", model, exc)
            return
        self._set(rollout)

    def replace_all(self, documents: dict[str, bytes]) -> None:
        """A full read of the prefix (after start or reconnect)."""
        for model in [m for m in self.rollouts if m not in documents]:
            self.apply(model, None)
        for model, raw in documents.items():
            self.apply(model, raw)

    def _set(self, rollout: Rollout) -> None:
        before = self.rollouts.get(rollout.model)
        self.rollouts[rollout.model] = rollout
        if before != rollout:
            log.info(
                "rollout of %s: %s -> %s at %g%% (%s, mirror %g%%): %s",
                rollout.model,
                rollout.stable,
                rollout.candidate,
                rollout.weight,
                rollout.state.value,
                rollout.mirror_percent,
                rollout.reason,
            )
        if not rollout.running:
            self._gates.pop(rollout.model, None)
            return
        gate = self._gates.get(rollout.model)
        same_trial = (
            before is not None
            and before.running
            and (before.stable, before.candidate) == (rollout.stable, rollout.candidate)
        )
        if gate is None or not same_trial:
            self._gates[rollout.model] = SloGate(rollout.gate, started_at=self.clock())
        else:
            gate.policy = rollout.gate  # a weight or threshold change keeps the samples

    # ----- routing --------------------------------------------------------------------

    def route(self, request: InferenceRequest) -> Route | None:
        """The request's version under the model's rollout; None when there is none."""
        rollout = self.rollouts.get(request.model)
        if rollout is None:
            return None
        route = choose(rollout, request.tenant, request.session_id, request.request_id)
        self.metrics.version_requests.add(
            1, {"model": request.model, "version": route.version, "role": route.role.value}
        )
        return route

    def fell_back(self, model: str, route: Route) -> None:
        self.metrics.fallbacks.add(1, {"model": model, "role": route.role.value})

    def mirror(
        self, request: InferenceRequest, idle_worker: Callable[[str], WorkerRecord | None], deadline: float
    ) -> MirrorHandle | None:
        """Starts the mirrored copy of a request on the candidate (or drops it)."""
        rollout = self.rollouts.get(request.model)
        if rollout is None or not rollout.running:
            return None
        return self.mirrors.offer(request, rollout.candidate, idle_worker(rollout.candidate), deadline)

    # ----- the gate -------------------------------------------------------------------

    def _gate_for(self, model: str, version: str) -> SloGate | None:
        rollout = self.rollouts.get(model)
        if rollout is None or not rollout.running or rollout.candidate != version:
            return None
        return self._gates.get(model)

    def observe(self, model: str, version: str, ok: bool, ttft_ms: float | None = None) -> None:
        """One attempt's outcome on `version`: counted only when it is a running candidate.
        `ok` False means a worker fault (client errors and overload are not reported)."""
        gate = self._gate_for(model, version)
        if gate is None:
            return
        gate.record(self.clock(), ok, ttft_ms)
        self._evaluate(model)

    def _compared(self, comparison: Comparison) -> None:
        model, mirror = comparison.model, comparison.mirror
        if comparison.primary.ttft_ms is not None:
            self.metrics.mirror_latency.record(comparison.primary.ttft_ms, {"model": model, "side": "primary"})
        if mirror.ttft_ms is not None:
            self.metrics.mirror_latency.record(mirror.ttft_ms, {"model": model, "side": "candidate"})
        if comparison.agreement is not None:
            self.metrics.token_agreement.record(comparison.agreement, {"model": model})
        if comparison.business_score is not None:
            self.metrics.business_score.record(comparison.business_score, {"model": model})
        if mirror.error is None:
            self.observe(model, comparison.candidate, True, mirror.ttft_ms)
        elif mirror.fault:
            self.observe(model, comparison.candidate, False)

    def reading(self, model: str) -> GateReading | None:
        gate = self._gates.get(model)
        return gate.reading(self.clock()) if gate is not None else None

    def _evaluate(self, model: str) -> None:
        reading = self.reading(model)
        if reading is None or reading.verdict is Verdict.HOLD or model in self._deciding:
            return
        if self.leader is None or not self.leader.is_leader:
            return  # the leader's gate decides; this router only follows the document
        self._deciding.add(model)
        task = asyncio.create_task(self._decide(self.rollouts[model], reading), name=f"rollout-decide-{model}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _decide(self, seen: Rollout, reading: GateReading) -> None:
        model = seen.model
        session = self.session
        if session is None:  # never started: no etcd to write the decision to
            self._deciding.discard(model)
            return
        decision = reading.verdict.value

        async def write(store: RolloutStore) -> Rollout | None:
            stored = await store.read(model)
            current = stored.rollout if stored is not None else None
            if (
                current is None
                or not current.running
                or (current.stable, current.candidate) != (seen.stable, seen.candidate)
            ):
                return None  # decided or replaced meanwhile
            decided = current.decided(VERDICT_PHASE[reading.verdict], f"gate: {reading.reason}")
            return decided if await store.swap(decided, stored.mod_revision) else None

        try:
            decided = await write(await store_over(session, self.etcd))
        except ETCD_ERRORS as exc:
            log.warning("could not write the %s of %s's rollout (will retry): %s", decision, model, exc)
            return
        except RolloutError as exc:
            log.error("rollout document of %s became invalid; no decision written: %s", model, exc)
            return
        finally:
            self._deciding.discard(model)
        outcome = "lost_race" if decided is None else "written"
        self.metrics.decisions.add(1, {"model": model, "decision": decision, "outcome": outcome})
        if decided is not None:
            log.warning("rollout of %s: %s of %s (%s)", model, decision, seen.candidate, reading.reason)
            self._set(decided)  # at once here; the watch brings it to the other routers

    async def _tick(self) -> None:
        # Promotion is due when the window has passed, even if no request arrives then.
        while True:
            await asyncio.sleep(TICK_S)
            for model in list(self._gates):
                self._evaluate(model)

    # ----- lifecycle ------------------------------------------------------------------

    async def start(self, session: EtcdSession | None = None) -> None:
        """Follows the documents and campaigns for the gate over `session` (the process's: its
        owner closes it; None: one of the controller's own, closed by stop()). Without etcd
        there is nothing to follow."""
        if self.etcd is None:
            return
        self._owns_session = session is None
        self.session = session or EtcdSession(self.etcd)
        self._watch = RolloutWatch(self.etcd, self.replace_all, self.apply, self.session)
        self.leader = LeaderLock(self.etcd, LEADER_LOCK, self._identity, session=self.session)
        await self._watch.start()
        await self.leader.start()
        task = asyncio.create_task(self._tick(), name="rollout-gate-tick")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        if self._watch is not None:
            await self._watch.stop()
        if self.leader is not None:
            await self.leader.stop()
        tasks = list(self._tasks) + list(self.mirrors.tasks)
        await asyncio.gather(*(stop_task(task) for task in tasks))
        # Last, once nothing here uses it; a session it was given stays open for its owner.
        if self._owns_session and self.session is not None:
            await self.session.close()
