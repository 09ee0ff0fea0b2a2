"""`ballast.v1.Backfill`: better answers pushed to the user once per ticket, or read on demand.

A subscription first pushes what its session (or ticket) already has, oldest original request
first, then waits for notices. Before pushing answers it takes their delivery marks as leases
(a ticket's alone; a session's ready answers together, in one script): of all subscriptions on
every replica, one pushes each ticket. Once a push is written its mark is kept for the answer's
lifetime. If a push cannot be written (the client left), the marks of it and of the rest of its
batch are given back, with a notice, so the next subscription gets them; a subscription that
dies holding marks loses them when their lease expires. Callers only ever see their own
tenant's answers. GetAnswer without an answer says why, as a fault: `backfill_pending` (NOT_FOUND:
not ready yet, or not the caller's), `backfill_expired` (NOT_FOUND: kept for its retention and
removed) or `backfill_lost` (DATA_LOSS: stored, and no longer in the store).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator

import grpc
from redis.exceptions import RedisError

from ballast.v1 import backfill_pb2, backfill_pb2_grpc
from services.backfill.metrics import BackfillMetrics
from services.backfill.settings import BackfillSettings
from services.backfill.store import AnswerState, AnswerStore, Notices
from services.common.auth import Authenticator
from services.common.degraded.targets import check_ticket, subscription_target
from services.common.errors import BackfillExpired, BackfillLost, BackfillPending, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)
# Answers one wake of a session subscription claims at most; it reads again at once for more.
CLAIM_BATCH = 64


class BackfillServicer(backfill_pb2_grpc.BackfillServicer):
    def __init__(
        self,
        settings: BackfillSettings,
        auth: Authenticator,
        store: AnswerStore,
        notices: Notices,
        metrics: BackfillMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.auth = auth
        self.store = store
        self.notices = notices
        self.metrics = metrics
        self.subscribers = 0

    async def GetAnswer(self, request: backfill_pb2.GetAnswerRequest, context: grpc.aio.ServicerContext):
        tenant = self.auth.tenant_for(context.invocation_metadata())
        ticket = check_ticket(request.ticket)
        answer = await self._redis(self.store.get(ticket))
        if answer is not None and answer.tenant == tenant:
            return answer
        # Another tenant's ticket looks exactly like one that is not ready.
        state = await self._redis(self.store.state(ticket, tenant))
        if state is AnswerState.EXPIRED:
            raise BackfillExpired(
                f"the answer for ticket {ticket} was kept for {self.settings.answer_retention_s} s and has expired"
            )
        if state is AnswerState.LOST:
            raise BackfillLost(f"the answer for ticket {ticket} was stored and is no longer in the answer store")
        raise BackfillPending(f"no answer for ticket {ticket} yet")

    async def Subscribe(
        self, request: backfill_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[backfill_pb2.BackfilledAnswer]:
        tenant = self.auth.tenant_for(context.invocation_metadata())
        which, target = subscription_target(request)
        if which == "ticket":
            ticket = target
            keys = [("ticket", ticket)]
        else:
            session_id = target
            keys = [("session", tenant, session_id)]
        if self.subscribers >= self.settings.max_subscribers:
            raise ResourceExhausted(f"{self.subscribers} subscriptions are open; try again later", retry_after_s=5.0)
        subscriber = uuid.uuid4().hex
        self.subscribers += 1
        wake = self.notices.watch(keys)
        ends_at = time.monotonic() + self.settings.subscribe_max_s
        try:
            while time.monotonic() < ends_at:
                # Cleared before reading, so a notice during the read wakes the next wait.
                wake.clear()
                if which == "ticket":
                    answer, taken_elsewhere = await self._claim_ticket(tenant, ticket, subscriber)
                    if taken_elsewhere:
                        return  # pushed to another subscription already; GetAnswer reads it
                    answers = [answer] if answer is not None else []
                else:
                    answers = await self._redis(self.store.claim_session(tenant, session_id, subscriber, CLAIM_BATCH))
                for i, answer in enumerate(answers):
                    try:
                        yield answer
                    except BaseException:
                        # Not written: let the next subscription push these. Shielded: we may be cancelled.
                        await asyncio.shield(self._give_back(answers[i:], subscriber))
                        raise
                    # Shielded too: the push is out, and a lease left to expire would send it again.
                    await asyncio.shield(self._confirm(answer, subscriber))
                    if self.metrics is not None:
                        self.metrics.delivered.add(1)
                if which == "ticket" and answers:
                    return
                if len(answers) == CLAIM_BATCH:
                    continue  # more may be waiting
                try:
                    remaining = max(0.0, ends_at - time.monotonic())
                    # Not asyncio.wait_for, which can swallow a cancellation as the event fires.
                    async with asyncio.timeout(min(self.settings.subscribe_poll_s, remaining)):
                        await wake.wait()
                except TimeoutError:
                    pass
        finally:
            self.notices.unwatch(keys, wake)
            self.subscribers -= 1

    async def _claim_ticket(
        self, tenant: str, ticket: str, subscriber: str
    ) -> tuple[backfill_pb2.BackfilledAnswer | None, bool]:
        """The ticket's answer if it is ready, the tenant's, and now claimed by this subscriber;
        and whether another subscription claimed it first."""
        answer = await self._redis(self.store.get(ticket))
        if answer is None or answer.tenant != tenant:
            return None, False
        if not await self._redis(self.store.claim(ticket, subscriber)):
            return None, True
        return answer, False

    async def _confirm(self, answer: backfill_pb2.BackfilledAnswer, subscriber: str) -> None:
        """Keeps the mark of a written push for the answer's lifetime, trying again while the
        store is away for up to half the lease; past that the lease may expire and the answer
        be pushed again (twice rather than never)."""
        deadline = time.monotonic() + self.settings.claim_lease_s / 2
        delay = 0.1
        while True:
            try:
                if not await self.store.confirm(answer.ticket, subscriber):
                    log.warning(
                        "the lease on %s expired before its push was confirmed; it may be pushed again", answer.ticket
                    )
                return
            except (RedisError, OSError) as exc:
                if time.monotonic() + delay > deadline:
                    log.warning("could not confirm the push of %s (%r); it may be pushed again", answer.ticket, exc)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _give_back(self, answers: list[backfill_pb2.BackfilledAnswer], subscriber: str) -> None:
        for answer in answers:
            try:
                await self.store.unclaim(answer, subscriber)
            except Exception as exc:  # noqa: BLE001 - best effort; GetAnswer still has it
                log.warning("could not release delivery mark of %s: %r", answer.ticket, exc)

    @staticmethod
    async def _redis(awaitable):
        try:
            return await awaitable
        except (OSError, ConnectionError) as exc:
            raise Unavailable(f"answer store unreachable: {exc}") from None
        except Exception as exc:
            if isinstance(exc, RedisError):
                raise Unavailable(f"answer store unreachable: {exc}") from None
            raise
