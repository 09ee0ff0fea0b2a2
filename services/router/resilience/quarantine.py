"""Poison containment on the router: a request that kills the workers it runs on is tried on
at most one more, then quarantined by fingerprint (see services.common.quarantine).

A worker loss counts against a request only when the request may be the cause (`implication`):
the worker died, or stalled or lost its lease while it relayed nothing to anyone and did not say
that its engine kept computing (see services.router.resilience.failover.worker_died and
WorkerProgress.silent), before this attempt relayed a single token. That is
where a query of death strikes (a schema that blows up the grammar compiler, a prompt that
crashes prefill or runs the engine out of memory). A worker killed while it streams answers is
the worker's fault, not each of its streams': those resume as before and are never quarantined.

A worker killed or stalled with a long queue (an overload, two faults close together) would
implicate every request in its line, yet an engine prefills a few at a time, so those far
back had most likely not been begun. A loss of a request that waited behind a full prefill
batch (`max_prefill_batch` of this router's requests ahead of it, sent there before it, of
its tier or a more urgent one, none with a first token; see
services.router.scheduling.waiting_line) is excused: not counted. Once per fingerprint in the
tally's window: the router cannot see the engine's batch, and a query of death that happened
to stand far back in two lines must not go free, so it costs at most one worker more than
`max_workers_lost`. A request that waited through two faults in a row is then no longer
quarantined for it, unless it is lost a third time without a token in between.

A loss is *taken on* when the router had read the worker's accepted event (the worker took the
call, then died), *unconfirmed* when it had not: the worker may have died before the request
reached it (a worker already gone, a network cut), or taken it and died so fast that its
accepted event went down unread with the connection (a router slow to read, a crash within
microseconds). A request is quarantined once its losses reach `max_workers_lost` with at least
one of them taken on, so unconfirmed losses alone (a partition that swallows every attempt)
never quarantine a request. And every attempt that follows a failed attempt of the same
request, or of a request that already cost a worker, asks the worker to wait for this router's
confirm of its accepted event before the engine sees it (`wants_confirmation`, Relay's
`confirm_accepted`): such an attempt lost before its accepted event was read never reached the
engine and counts for nothing (a worker killed at the same moment as the one before, or already
dead: a stream lost mid-answer with its machine and resumed onto another dying with it), and
one lost after it is taken on for sure, so a query of death costs `max_workers_lost` workers,
however slowly this router reads.

A loss is a worker's, not a request's: the losses of a fingerprint are the distinct worker
incarnations (a worker id and the lease it held) lost with a copy of it, so one worker killed
with fifty copies of a popular prompt in prefill counts once against that prompt, not fifty
times; a worker that restarts under its keeper and dies again on the same poison is a new
incarnation and counts again.

Losses are tallied per fingerprint for the quarantine's time to live, so the count holds
across a request's resumes and across its retries under new request ids (a backfill replay
too). At `max_workers_lost` the fingerprint is quarantined: held here at once, written to
etcd for the other routers and the backfill, and refused with `Quarantined` until it lapses.

A fingerprint's losses are forgiven (`passed`) when an attempt that asked for a confirm, one
made after it cost a worker, relays its first token: it got past where a query of death
strikes, so the worker lost before was lost with it, not to it (a worker killed with several
requests in prefill implicates each of them). Without that, a popular request (the same
prompt from many users, a health probe) would be quarantined for everyone once two workers
died in ten minutes with a copy of it in prefill each time, and a poison still is: it never
relays a token between the workers it kills.
"""

from __future__ import annotations

import logging
import time
import enum
from typing import Any, NamedTuple

from pydantic import Field

from services.common.config import EtcdConfig, Section
from services.common.etcd_session import EtcdSession
from services.common.errors import Quarantined
from services.common.quarantine import Clock, QuarantineEntry, QuarantineStore, request_fingerprint
from services.common.quarantine_etcd import QuarantinePublisher, QuarantineWatch

log = logging.getLogger(__name__)


# How long before a stall a worker's word that its engine moved still counts (engine_quiet_s):
# above the workers' report interval (0.5 s) and the longest step of an engine on CPUs.
DEFAULT_ENGINE_QUIET_S = 5.0


class QuarantineConfig(Section):
    enabled: bool = Field(True, description="Quarantine requests that kill or stall the workers they run on.")
    max_workers_lost: int = Field(
        2,
        ge=1,
        le=10,
        description="Workers a request may cost (died, stalled or ran out of memory taking it on) "
        "before it is quarantined; it is tried on one more worker after each loss below it. At "
        "least one of the losses must be a worker that confirmed taking the request on.",
    )
    max_prefill_batch: int = Field(
        8,
        ge=1,
        le=4096,
        description="Requests an engine prefills at once, at the most. A worker lost while at least "
        "this many of this router's requests waited ahead of a request for their first token (sent "
        "there before it, of its tier or a more urgent one) is excused to that request once per "
        "ttl_s: it was most likely queued behind the prefill, not in it. Raise it for engines that "
        "prefill many short prompts in one step; a query of death taken for queued costs one more "
        "worker before its quarantine.",
    )
    engine_quiet_s: float = Field(
        DEFAULT_ENGINE_QUIET_S,
        gt=0,
        le=600,
        description="A worker that stalled a request's first token while it relayed nothing is still "
        "busy, not wedged, when it said within this many seconds before the stall that its engine "
        "computed steps (worker.engine_progress_ms): the loss is not counted. Keep it above the "
        "workers' engine_progress_ms and their longest engine step; an engine wedged this long "
        "before the stall reads as silent.",
    )
    ttl_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="How long a quarantined fingerprint is refused (and how long its losses are remembered).",
    )
    max_entries: int = Field(
        10_000, ge=1, description="Quarantined fingerprints (and tallies of losses) held in memory at most."
    )


class Implication(enum.Enum):
    """What a failed attempt says against its request."""

    NONE = "none"
    # The worker took the call on (the router read its accepted event), then was lost.
    TAKEN_ON = "taken_on"
    # The worker was lost before the router read an accepted event: it may never have had the
    # request, or died taking it on faster than the router read.
    UNCONFIRMED = "unconfirmed"


def implication(lost: bool, tokens_this_attempt: int, accepted: bool, confirm_asked: bool = False) -> Implication:
    """Whether a failed attempt counts against its request: the worker died, stalled or lost
    its lease before relaying any token of this attempt (taken on or unconfirmed). An attempt
    that asked its worker to confirm (`confirm_asked`) and was lost before its accepted event
    was read never reached the engine: the worker died of something else (several workers
    lost at once, one already dead when the request was sent), so it counts for nothing."""
    if not lost or tokens_this_attempt > 0:
        return Implication.NONE
    if accepted:
        return Implication.TAKEN_ON
    return Implication.NONE if confirm_asked else Implication.UNCONFIRMED


class Losses(NamedTuple):
    """A fingerprint's workers lost in the tally's window, by implication."""

    taken_on: int = 0
    unconfirmed: int = 0

    @property
    def total(self) -> int:
        return self.taken_on + self.unconfirmed


def incarnation_of(worker: Any) -> str:
    """Which life of a worker a loss ended: its lease (a worker restarted by its keeper, or
    registered again, holds a new one) and its start time (for a record read without a lease)."""
    return f"{worker.lease_id:x}@{worker.started_at:.3f}"


class LossTally:
    """Distinct workers lost per fingerprint within `window_s` of the last loss; at most
    `max_entries` fingerprints (the stalest go first). `clock` gives seconds (injectable in
    tests)."""

    def __init__(self, window_s: float, max_entries: int, clock: Clock = time.monotonic) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._clock = clock
        # fingerprint -> ({worker incarnation: taken on}, time of the last loss); insertion
        # order is staleness order. A fingerprint is quarantined (and forgotten here) at
        # QuarantineConfig.max_workers_lost (at most 10), so each holds few workers.
        self._losses: dict[str, tuple[dict[tuple[str, str], bool], float]] = {}
        # fingerprint -> when a loss of it was last excused as queued (see `excuse`).
        self._excused: dict[str, float] = {}

    def add(self, fp: str, worker: str, taken_on: bool = True, incarnation: str = "") -> Losses:
        """Counts `worker` (in `incarnation`) lost to `fp`, once however many copies of `fp`
        it had (taken on if any copy was); returns the fingerprint's losses in the window."""
        now = self._clock()
        workers, last = self._losses.pop(fp, ({}, now))
        if now - last > self.window_s:
            workers = {}
        key = (worker, incarnation)
        workers[key] = workers.get(key, False) or taken_on
        self._losses[fp] = (workers, now)
        while len(self._losses) > self.max_entries:
            del self._losses[next(iter(self._losses))]
        confirmed = sum(workers.values())
        return Losses(taken_on=confirmed, unconfirmed=len(workers) - confirmed)

    def excuse(self, fp: str) -> bool:
        """Whether a loss of `fp` that waited behind a full prefill batch may go uncounted:
        once per fingerprint within the window (the excuse is remembered as losses are)."""
        now = self._clock()
        last = self._excused.pop(fp, None)
        if last is not None and now - last <= self.window_s:
            self._excused[fp] = last
            return False
        self._excused[fp] = now
        while len(self._excused) > self.max_entries:
            del self._excused[next(iter(self._excused))]
        return True

    def has_lost_workers(self, fp: str) -> bool:
        """Whether `fp` cost a worker within the window (a loss excused as queued included)."""
        now = self._clock()
        held = self._losses.get(fp)
        if held is not None and now - held[1] <= self.window_s:
            return True
        excused = self._excused.get(fp)
        return excused is not None and now - excused <= self.window_s

    def forget(self, fp: str) -> None:
        self._losses.pop(fp, None)
        self._excused.pop(fp, None)

    def __len__(self) -> int:
        """Fingerprints with a loss or an excuse held (0: none to look up)."""
        return len(self._losses) + len(self._excused)


class RouterQuarantine:
    """The router's quarantine: refuses quarantined requests, counts worker losses, publishes."""

    def __init__(
        self,
        config: QuarantineConfig,
        etcd: EtcdConfig | None = None,
        counter: Any = None,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
        session: EtcdSession | None = None,
    ) -> None:
        self.config = config
        self.store = QuarantineStore(config.max_entries, clock)
        self.tally = LossTally(config.ttl_s, config.max_entries, monotonic)
        self._clock = clock
        # ballast_router_quarantine{event=quarantined|refused}
        self._counter = counter
        # Both over the router's etcd session when given (the router closes it).
        self.watch = QuarantineWatch(etcd, self.store, session) if etcd is not None else None
        self.publisher = QuarantinePublisher(etcd, self.store, session=session) if etcd is not None else None

    async def start(self) -> None:
        if self.publisher is not None:
            await self.publisher.start()
        if self.watch is not None:
            await self.watch.start()

    async def stop(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
        if self.publisher is not None:
            await self.publisher.stop()

    def _count(self, event: str) -> None:
        if self._counter is not None:
            self._counter.add(1, {"event": event})

    def check(self, request: Any) -> None:
        """Raises Quarantined when the request's fingerprint is quarantined now."""
        if not self.config.enabled or self.store.is_empty():
            return  # nothing quarantined: no fingerprint to compute
        fp = request_fingerprint(request)
        entry = self.store.get(fp)
        if entry is None:
            return
        self._count("refused")
        raise self._error(fp, entry, request.request_id)

    def queued(self, waiting_ahead: int) -> bool:
        """Whether a request with `waiting_ahead` requests ahead of it on a lost worker, all
        without their first token (see scheduling.waiting_line), most likely waited behind
        the engine's prefill rather than in it (`worker_lost` may excuse the loss)."""
        return waiting_ahead >= self.config.max_prefill_batch

    def wants_confirmation(self, request: Any, follows_failure: bool = False) -> bool:
        """Whether an attempt of `request` should have its worker wait for this router's
        confirm of the accepted event: the attempt follows a failed one of the same request
        (`follows_failure`: the worker before may have died in the same event as this one,
        a machine or a rack lost, so this one may be dying too), or the request already cost
        a worker."""
        if not self.config.enabled:
            return False
        if follows_failure:
            return True
        if not len(self.tally):
            return False  # no loss tallied: no fingerprint to compute
        return self.tally.has_lost_workers(request_fingerprint(request))

    def passed(self, request: Any) -> None:
        """An attempt of `request` that asked for a confirm (see `wants_confirmation`) relayed
        its first token: forgets its fingerprint's losses."""
        if not self.config.enabled:
            return
        fp = request_fingerprint(request)
        if self.tally.has_lost_workers(fp):
            self.tally.forget(fp)
            log.info(
                "request %s (fingerprint %s) streamed after costing a worker: its losses are forgiven",
                request.request_id,
                fp[:16],
            )

    def worker_lost(
        self,
        request: Any,
        reason: str,
        worker_id: str,
        taken_on: bool = True,
        incarnation: str = "",
        queued: bool = False,
    ) -> None:
        """Counts a worker (`worker_id` in its `incarnation`, see `incarnation_of`) lost to
        `request` (see `implication`), unless the request waited behind a full prefill batch
        (`queued`) and its fingerprint has not had that excuse in the window; raises
        Quarantined when that was one too many."""
        if not self.config.enabled:
            return
        fp = request_fingerprint(request)
        if queued and self.tally.excuse(fp):
            log.info(
                "request %s (fingerprint %s) lost worker %s (%s) while queued behind a full prefill "
                "batch: not counted (its one such excuse in %.0fs)",
                request.request_id,
                fp[:16],
                worker_id,
                reason,
                self.config.ttl_s,
            )
            return
        losses = self.tally.add(fp, worker_id, taken_on, incarnation)
        lost = losses.total
        if lost < self.config.max_workers_lost or losses.taken_on == 0:
            log.warning(
                "request %s (fingerprint %s) lost worker %s (%s, %s): %d of %d before quarantine",
                request.request_id,
                fp[:16],
                worker_id,
                reason,
                "taking it on" if taken_on else "before it confirmed taking it on",
                lost,
                self.config.max_workers_lost,
            )
            return
        self.tally.forget(fp)
        entry = QuarantineEntry(
            fingerprint=fp,
            tenant=request.tenant,
            reason=reason,
            since=self._clock(),
            workers_lost=lost,
            ttl_s=self.config.ttl_s,
        )
        self.store.add(entry)
        if self.publisher is not None:
            self.publisher.publish(entry)
        self._count("quarantined")
        log.error(
            "request %s (fingerprint %s, tenant %s) quarantined for %.0fs: it cost %d workers (last %s, %s)",
            request.request_id,
            fp[:16],
            request.tenant,
            self.config.ttl_s,
            lost,
            worker_id,
            reason,
        )
        raise self._error(fp, entry, request.request_id)

    def _error(self, fp: str, entry: QuarantineEntry, request_id: str) -> Quarantined:
        remaining = self.store.remaining_s(entry)
        return Quarantined(
            f"request {request_id} is quarantined (fingerprint {fp[:16]}): requests like it cost "
            f"{entry.workers_lost} workers; refused for another {remaining:.0f}s",
            retry_after_s=remaining,
        )
