"""Asyncio front of a PoolScheduler: coroutines wait for a worker slot, hold it, give it back.

`async with gate.slot(ticket) as grant:` submits the ticket (a refusal raises
ResourceExhausted with a retry hint), waits until the scheduler dispatches it, never past
the ticket's wait limit, and yields a Grant naming the worker. Leaving the block frees the
slot and hands it to the next ticket at once.

When an S request needs the slot, `grant.preempted` is set (and the optional callback runs):
the holder aborts its worker stream and calls `await grant.resume()`, which queues the
ticket again with the tokens it has and returns when it holds a slot again.

Cancellation-safe: a cancelled waiter leaves the queue; a cancelled holder frees its slot.
Everything the gate keeps is per live ticket, so it is bounded by the scheduler's queues.
"""

from __future__ import annotations

import asyncio
import math
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Mapping

from services.common.errors import BallastError, DeadlineExceeded, ResourceExhausted
from services.router.scheduling.scheduler import (
    Admission,
    PoolScheduler,
    Ticket,
    TicketState,
    WorkerSlots,
)
from services.router.scheduling.waiting_line import LostLines

WorkersFn = Callable[[], Mapping[str, WorkerSlots | tuple[int, int]]]
PreemptCallback = Callable[["Grant"], None]


class Grant:
    """A ticket's hold on one worker slot, valid inside `gate.slot(...)`."""

    def __init__(self, gate: "AsyncGate", ticket: Ticket, on_preempt: PreemptCallback | None) -> None:
        self.ticket = ticket
        self.preempted = asyncio.Event()
        self._gate = gate
        self._on_preempt = on_preempt

    @property
    def worker_id(self) -> str:
        worker = self.ticket.worker_id
        if worker is None or self.ticket.state is not TicketState.RUNNING:
            raise RuntimeError(f"ticket {self.ticket.request_id} holds no slot ({self.ticket.state.value})")
        return worker

    def first_token(self) -> None:
        """Call when the worker sends its first token (measures dispatch-to-first-token)."""
        self._gate.scheduler.on_first_token(self.ticket)

    def waiting_ahead_at_loss(self, last_token_at: float | None) -> int:
        """How many requests waited for their first token ahead of this one on its worker
        when the worker was lost (see waiting_line): call it when the attempt ended with the
        worker's loss, before the slot is given up; `last_token_at`: when the worker last
        relayed a token to anyone (monotonic; None: never)."""
        worker = self.worker_id
        scheduler = self._gate.scheduler
        return self._gate.lost_lines.waiting_ahead(
            worker, self.ticket, lambda: scheduler.running_on(worker), last_token_at
        )

    def add_tokens(self, token_ids: list[int]) -> None:
        """Remembers tokens sent to the client, so a preempted stream can resume from them."""
        self.ticket.add_tokens(token_ids)

    async def resume(self) -> str:
        """After preemption: gives the slot up, queues again keeping the tokens, waits for a slot.

        Returns the new worker id. Raises ResourceExhausted (or DeadlineExceeded) when no slot
        comes within the ticket's wait limit.
        """
        self.preempted.clear()
        if not self._gate.scheduler.requeue_preempted(self.ticket):
            raise self._gate._expired_error(self.ticket)
        # The wait pumps, so the freed slot goes at once to whoever is first in line.
        await self._gate._wait(self.ticket)
        return self.worker_id

    async def retry_elsewhere(self) -> str:
        """After a worker failed before answering: queues again, ahead of newer work, on another worker."""
        self.preempted.clear()
        if not self._gate.scheduler.requeue_failed(self.ticket):
            raise self._gate._expired_error(self.ticket)
        # The wait pumps, so the freed slot goes at once to whoever is first in line.
        await self._gate._wait(self.ticket)
        return self.worker_id

    def _preempt(self) -> None:
        self.preempted.set()
        if self._on_preempt is not None:
            self._on_preempt(self)


class AsyncGate:
    """Lets coroutines of one event loop share a pool's slots through its PoolScheduler."""

    def __init__(self, scheduler: PoolScheduler, workers: WorkersFn) -> None:
        self.scheduler = scheduler
        self._workers = workers
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        self._grants: dict[Ticket, Grant] = {}
        self.lost_lines = LostLines()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def holders(self) -> int:
        return len(self._grants) - len(self._waiters)

    @asynccontextmanager
    async def slot(self, ticket: Ticket, on_preempt: PreemptCallback | None = None) -> AsyncIterator[Grant]:
        admission = self.scheduler.submit(ticket, self._workers())
        if not admission.admitted:
            if admission.reason == "deadline":
                raise DeadlineExceeded("deadline exceeded before the request could queue")
            raise ResourceExhausted(self._refusal_message(ticket, admission), admission.retry_after_s)
        grant = Grant(self, ticket, on_preempt)
        self._grants[ticket] = grant
        completed = False
        try:
            await self._wait(ticket)
            yield grant
            completed = True
        finally:
            self._grants.pop(ticket, None)
            if completed:
                self.scheduler.on_finished(ticket)
            # Whatever else happened (error, cancellation, timeout), leave the queue or free the slot.
            self.scheduler.cancel(ticket)
            self.pump()

    def pump(self) -> None:
        """Hands free slots to waiters, refuses expired ones, and signals preemptions.

        Runs after every event of the gate; call it too when membership changes (a new
        worker, or one whose published in-flight dropped).
        """
        while True:
            plan = self.scheduler.dispatch(self._workers())
            for ticket in plan.expired:
                future = self._waiters.get(ticket)
                if future is not None and not future.done():
                    future.set_exception(self._expired_error(ticket))
            abandoned = False
            for ticket, _worker in plan.started:
                future = self._waiters.get(ticket)
                if future is None or future.done():
                    # Its waiter gave up in the same instant: the slot goes to the next one.
                    self.scheduler.cancel(ticket)
                    abandoned = True
                else:
                    future.set_result(None)
            if not abandoned:
                break
        for victim in self.scheduler.plan_preemptions():
            grant = self._grants.get(victim)
            if grant is not None:
                grant._preempt()

    async def _wait(self, ticket: Ticket) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = future
        try:
            self.pump()
            if future.done():
                future.result()
                return
            timeout = ticket.expires_at - self.scheduler.clock()
            try:
                # Not asyncio.wait_for: it can swallow a cancellation that lands just as the
                # future completes, and a cancelled waiter must never go on to hold a slot.
                async with asyncio.timeout(None if math.isinf(timeout) else max(0.0, timeout)):
                    await future
            except TimeoutError:
                if ticket.state is TicketState.RUNNING:
                    return  # dispatched at the very moment the limit passed: use the slot
                raise self._expired_error(ticket) from None
        finally:
            # The caller's cleanup (slot exit) takes the ticket out of the queue or frees its slot.
            self._waiters.pop(ticket, None)

    def _expired_error(self, ticket: Ticket) -> BallastError:
        now = self.scheduler.clock()
        if ticket.client_deadline is not None and now >= ticket.client_deadline:
            return DeadlineExceeded("deadline exceeded while waiting for a worker slot")
        policy = self.scheduler.policy
        wait = self.scheduler.estimated_wait(ticket.tier, ticket.tenant)
        retry = min(policy.max_retry_after_s, max(policy.min_retry_after_s, wait))
        return ResourceExhausted(
            f"pool {self.scheduler.pool}: tier {ticket.tier} request waited {now - ticket.arrival:.2f}s "
            f"without a free slot",
            retry_after_s=retry,
        )

    def _refusal_message(self, ticket: Ticket, admission: Admission) -> str:
        pool, tier = self.scheduler.pool, ticket.tier
        if admission.reason == "queue_full":
            return f"pool {pool}: tier {tier} queue is full"
        if admission.reason == "no_capacity":
            return f"pool {pool}: no worker capacity"
        budget = self.scheduler.policy.spec(tier).budget_s
        return (
            f"pool {pool}: estimated wait {admission.estimated_wait_s:.2f}s for tier {tier} "
            f"exceeds its {budget:.2f}s budget"
        )
