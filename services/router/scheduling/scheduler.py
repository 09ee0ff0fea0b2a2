"""One model pool's scheduler: tiered queues, admission, dispatch to worker slots, preemption.

Pure and synchronous: no I/O, no tasks, time from an injected clock (monotonic seconds).
Longer than most modules on purpose: admission, the tier order, tenant fairness, preemption
and dispatch share one queue state, and splitting them would spread its invariants over
several files. The
caller hands in a snapshot of the pool's workers (advertised capacity and published
in-flight) and gets back which queued ticket goes to which worker; `AsyncGate` wraps this for coroutines.

Order of service (tiered mode):
- S is strict priority. When S waits and no slot is free, the youngest running B stream that
  has not used up its preemptions is asked to yield (`plan_preemptions`).
- A and B share what S leaves by smooth weighted round robin; A's weight rises with load.
- Inside a tier, tenants take turns (round robin), so one tenant's flood cannot starve
  another; inside a tenant, earliest deadline first (a larger weight makes the deadline earlier).

Admission refuses at once when the tier's queue is full or when the estimated wait exceeds
the tier's budget. The estimate comes from measured service times (moving average of how long
a request holds a slot, and of dispatch-to-first-token) and the work queued ahead of the
request at its priority, never from constants.

Among workers with free slots, the one with the largest free share wins; a worker that joined
while the router ran (a restart, a scale-out, or back from being unroutable) counts only part
of its free slots for its first `slow_start_s`, so it is not handed every new and resumed
stream at once.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple, Protocol

from services.common.tier import Tier
from services.router.scheduling.tiers import TIERS, TierPolicy

# Share of its free slots a worker that just joined gets at first (slow start).
_SLOW_START_FLOOR = 0.1


class TicketState(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    REFUSED = "refused"


@dataclass(eq=False)
class Ticket:
    """One request's place in a pool. Compared by identity: two tickets are never equal."""

    request_id: str
    tenant: str
    tier: Tier
    arrival: float
    # Earliest-deadline-first key: arrival + budget / weight (capped by the client's deadline).
    deadline: float
    # Leaves the queue refused when not dispatched by then (the tier's wait limit).
    expires_at: float
    weight: float = 1.0
    client_deadline: float | None = None
    preemptions: int = 0
    # Tokens already sent to the client: a preempted or failed-over request resumes from them.
    generated_ids: list[int] = field(default_factory=list, repr=False)
    # Workers this ticket must not go to (they already failed it).
    avoid: frozenset[str] = frozenset()
    # Worker to use when it has a free slot (it holds the session's KV cache).
    prefer: str | None = None
    # Fields below are the scheduler's.
    state: TicketState = TicketState.NEW
    worker_id: str | None = None
    enqueued_at: float = 0.0
    dispatched_at: float | None = None
    first_token_at: float | None = None
    preempting: bool = False
    seq: int = 0

    @property
    def tokens_generated(self) -> int:
        return len(self.generated_ids)

    def add_tokens(self, token_ids: Iterable[int]) -> None:
        self.generated_ids.extend(token_ids)


class WorkerSlots(NamedTuple):
    """What a worker advertises: a plain `(capacity, in_flight)` tuple works too."""

    capacity: int
    in_flight: int = 0


class _WorkerLike(Protocol):
    id: str
    capacity: int
    in_flight: int


def slots_from_records(records: Iterable[_WorkerLike]) -> dict[str, WorkerSlots]:
    """Capacity snapshot from membership records (already filtered to eligible workers)."""
    return {r.id: WorkerSlots(r.capacity, r.in_flight) for r in records}


@dataclass(frozen=True)
class Admission:
    admitted: bool
    # "queued", or why not: "queue_full", "over_budget", "no_capacity", "deadline".
    reason: str
    estimated_wait_s: float
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class DispatchPlan:
    started: list[tuple[Ticket, str]]
    expired: list[Ticket]


def _per_tier() -> dict[Tier, int]:
    return {tier: 0 for tier in TIERS}


@dataclass
class SchedulerCounters:
    """Monotonic counts since start, by tier; `refused` is keyed by (tier, reason)."""

    submitted: dict[Tier, int] = field(default_factory=_per_tier)
    dispatched: dict[Tier, int] = field(default_factory=_per_tier)
    finished: dict[Tier, int] = field(default_factory=_per_tier)
    cancelled: dict[Tier, int] = field(default_factory=_per_tier)
    expired: dict[Tier, int] = field(default_factory=_per_tier)
    preempted: dict[Tier, int] = field(default_factory=_per_tier)
    requeued: dict[Tier, int] = field(default_factory=_per_tier)
    refused: dict[tuple[Tier, str], int] = field(default_factory=dict)
    wait_s_total: dict[Tier, float] = field(default_factory=lambda: {tier: 0.0 for tier in TIERS})


class SchedulerObserver:
    """Metric hooks; the default does nothing. Subclass it to feed OpenTelemetry."""

    def queue_wait(self, pool: str, tier: Tier, seconds: float) -> None: ...

    def refused(self, pool: str, tier: Tier, reason: str) -> None: ...

    def expired(self, pool: str, tier: Tier) -> None: ...

    def preempted(self, pool: str, tier: Tier) -> None: ...


@dataclass(frozen=True)
class TierSnapshot:
    queued: int
    running: int
    oldest_wait_s: float
    estimated_wait_s: float


@dataclass(frozen=True)
class PoolSnapshot:
    pool: str
    mode: str
    tiers: dict[Tier, TierSnapshot]
    capacity: int
    free_slots: int
    load: float
    a_share: float
    hold_s: float
    first_token_s: float
    preempting: int


class _Ewma:
    """Exponentially weighted moving average that starts from a prior until measured."""

    def __init__(self, alpha: float, prior: float) -> None:
        self.alpha = alpha
        self.value = prior
        self.samples = 0

    def add(self, sample: float) -> None:
        sample = max(0.0, sample)
        # The first measurement replaces the prior outright: a guess should not linger.
        self.value = sample if self.samples == 0 else self.alpha * sample + (1 - self.alpha) * self.value
        self.samples += 1


Entry = tuple[float, int, Ticket]


class _TierQueue:
    """One tier's queue: round robin over tenants, earliest deadline first within a tenant."""

    def __init__(self) -> None:
        self._tenants: OrderedDict[str, list[Entry]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, ticket: Ticket, front: bool = False) -> None:
        heap = self._tenants.get(ticket.tenant)
        if heap is None:
            heap = self._tenants[ticket.tenant] = []
        if front:
            self._tenants.move_to_end(ticket.tenant, last=False)
        heapq.heappush(heap, (ticket.deadline, ticket.seq, ticket))
        self._size += 1

    def pop(self) -> Ticket:
        tenant, heap = next(iter(self._tenants.items()))
        ticket = heapq.heappop(heap)[2]
        if heap:
            # The tenant just had its turn: it goes to the back of the ring.
            self._tenants.move_to_end(tenant)
        else:
            del self._tenants[tenant]
        self._size -= 1
        return ticket

    def remove(self, ticket: Ticket) -> bool:
        heap = self._tenants.get(ticket.tenant)
        if not heap:
            return False
        for index, entry in enumerate(heap):
            if entry[2] is ticket:
                heap[index] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                if not heap:
                    del self._tenants[ticket.tenant]
                self._size -= 1
                return True
        return False

    def tickets(self) -> Iterator[Ticket]:
        for heap in self._tenants.values():
            for entry in heap:
                yield entry[2]

    def ahead_for(self, tenant: str | None) -> int:
        """Tickets served before a new ticket of `tenant` under round robin (upper bound)."""
        if tenant is None:
            return self._size
        own = len(self._tenants.get(tenant, ()))
        # Every other tenant gets at most one turn per turn of this tenant.
        return own + sum(min(len(heap), own + 1) for name, heap in self._tenants.items() if name != tenant)


class _FifoQueue:
    """The scheduling-off baseline: arrival order, nothing else."""

    def __init__(self) -> None:
        self._items: deque[Ticket] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, ticket: Ticket, front: bool = False) -> None:
        if front:
            self._items.appendleft(ticket)
        else:
            self._items.append(ticket)

    def pop(self) -> Ticket:
        return self._items.popleft()

    def remove(self, ticket: Ticket) -> bool:
        for index, item in enumerate(self._items):
            if item is ticket:
                del self._items[index]
                return True
        return False

    def tickets(self) -> Iterator[Ticket]:
        return iter(self._items)

    def ahead_for(self, tenant: str | None) -> int:
        return len(self._items)


class PoolScheduler:
    """Decides, for one model pool, which waiting request runs next and on which worker."""

    def __init__(
        self,
        policy: TierPolicy,
        clock: Callable[[], float] = time.monotonic,
        pool: str = "primary",
        observer: SchedulerObserver | None = None,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.pool = pool
        self.observer = observer or SchedulerObserver()
        self.counters = SchedulerCounters()
        self._tiered = policy.mode == "tiered"
        self._queues: dict[Tier, _TierQueue] = {tier: _TierQueue() for tier in TIERS}
        self._fifo = _FifoQueue()
        self._running: dict[Ticket, None] = {}
        self._local: dict[str, int] = {}
        # Where the next scan for a free worker starts (spreads ties).
        self._rotation = -1
        self._workers: dict[str, WorkerSlots] = {}
        # The mapping last observed, as given: an equal one changes nothing.
        self._observed: dict[str, WorkerSlots | tuple[int, int]] | None = None
        # When each worker incarnation entered the eligible snapshot (slow start); None: it was
        # in the first one. A worker that left it (hot, breaker open, unreachable) and comes
        # back ramps up again, like a new one.
        self._joined_at: dict[str, float | None] = {}
        # Our count on each worker when its published in-flight last changed: the part of
        # the published number that is ours, so the rest belongs to other routers.
        self._local_at_publish: dict[str, int] = {}
        # Expiry times of queued tickets; stale entries are skipped and periodically compacted.
        self._expiry: list[Entry] = []
        self._credits = {Tier.A: 0.0, Tier.B: 0.0}
        self._hold = _Ewma(policy.ewma_alpha, policy.initial_hold_s)
        self._first_token = _Ewma(policy.ewma_alpha, policy.initial_first_token_s)
        self._seq = itertools.count(1)

    # ----- tickets and workers -------------------------------------------------------------

    def new_ticket(
        self,
        request_id: str,
        tenant: str,
        tier: Tier,
        *,
        weight: float = 1.0,
        client_deadline: float | None = None,
        avoid: Iterable[str] = (),
        prefer: str | None = None,
    ) -> Ticket:
        """A ticket stamped now, with its EDF deadline and queue expiry from the tier policy."""
        spec = self.policy.spec(tier)
        if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"weight must be a finite number > 0 (got {weight!r})")
        now = self.clock()
        deadline = now + spec.budget_s / weight
        expires_at = now + spec.wait_limit_s if self._tiered else math.inf
        if client_deadline is not None:
            deadline = min(deadline, client_deadline)
            expires_at = min(expires_at, client_deadline)
        return Ticket(
            request_id=request_id,
            tenant=tenant,
            tier=Tier(tier),
            arrival=now,
            deadline=deadline,
            expires_at=expires_at,
            weight=float(weight),
            client_deadline=client_deadline,
            avoid=frozenset(avoid),
            prefer=prefer,
            seq=next(self._seq),
        )

    def observe_workers(self, workers: Mapping[str, WorkerSlots | tuple[int, int]]) -> None:
        """Replaces the capacity snapshot (eligible workers of this pool only)."""
        if workers == self._observed:
            return  # the same snapshot again (each request brings it several times): nothing changes
        self._observed = dict(workers)
        fresh = {wid: WorkerSlots(*slots) for wid, slots in workers.items()}
        first_snapshot = not self._joined_at
        now = self.clock()
        for wid in fresh:
            # Workers there when the router started are not new to the pool: full share.
            self._joined_at.setdefault(wid, None if first_snapshot else now)
        for wid in [w for w in self._joined_at if w not in fresh]:
            del self._joined_at[wid]
        for wid, slots in fresh.items():
            previous = self._workers.get(wid)
            if previous is None or previous.in_flight != slots.in_flight:
                self._local_at_publish[wid] = self._local.get(wid, 0)
        self._workers = fresh
        for wid in [w for w in self._local_at_publish if w not in fresh]:
            del self._local_at_publish[wid]

    def _busy(self, wid: str) -> int:
        """Slots of a worker in use: ours (exact) plus other routers' (published minus ours).

        A heartbeat lags: streams we started since it are not in it (we add them), streams
        we finished since it are still in it (we take them out).
        """
        slots = self._workers[wid]
        others = max(0, slots.in_flight - self._local_at_publish.get(wid, 0))
        return others + self._local.get(wid, 0)

    @property
    def capacity(self) -> int:
        return sum(max(0, slots.capacity) for slots in self._workers.values())

    def _free_slots(self) -> dict[str, int]:
        free: dict[str, int] = {}
        for wid, slots in self._workers.items():
            n = slots.capacity - self._busy(wid)
            if n > 0:
                free[wid] = n
        return free

    def load(self) -> float:
        """Demand over capacity: (busy slots + queued requests) / total slots."""
        capacity = self.capacity
        if capacity <= 0:
            return math.inf
        busy = sum(self._busy(wid) for wid in self._workers)
        return (busy + self.queued()) / capacity

    def queued(self, tier: Tier | None = None) -> int:
        if not self._tiered:
            if tier is None:
                return len(self._fifo)
            return sum(1 for t in self._fifo.tickets() if t.tier == tier)
        if tier is None:
            return sum(len(q) for q in self._queues.values())
        return len(self._queues[tier])

    def running(self, tier: Tier | None = None) -> int:
        if tier is None:
            return len(self._running)
        return sum(1 for t in self._running if t.tier == tier)

    def running_on(self, worker: str) -> list[Ticket]:
        """The tickets holding a slot on `worker` (a scan of every running ticket: for the
        rare paths, a worker's loss, not for dispatch)."""
        return [t for t in self._running if t.worker_id == worker]

    def _queue_for(self, tier: Tier) -> _TierQueue | _FifoQueue:
        return self._queues[tier] if self._tiered else self._fifo

    # ----- admission ----------------------------------------------------------------------

    def submit(self, ticket: Ticket, workers: Mapping[str, WorkerSlots | tuple[int, int]] | None = None) -> Admission:
        """Queues the ticket, or refuses it at once with a retry hint."""
        if ticket.state is not TicketState.NEW:
            raise ValueError(f"ticket {ticket.request_id} was already submitted ({ticket.state.value})")
        if workers is not None:
            self.observe_workers(workers)
        tier = ticket.tier
        spec = self.policy.spec(tier)
        self.counters.submitted[tier] += 1
        now = self.clock()
        if ticket.expires_at <= now:
            return self._refuse(ticket, "deadline", 0.0, self.policy.min_retry_after_s)
        wait = self.estimated_wait(tier, ticket.tenant)
        if math.isinf(wait):
            return self._refuse(ticket, "no_capacity", wait, self.policy.max_retry_after_s)
        queue = self._queue_for(tier)
        limit = spec.max_queue if self._tiered else self.policy.fifo_max_queue
        allowed = math.inf
        if self._tiered:
            # Wait that still leaves room for the measured dispatch-to-first-token time.
            allowed = min(spec.wait_limit_s, spec.budget_s - self._first_token.value, ticket.expires_at - now)
        if len(queue) >= limit:
            one_place = 1.0 / self._tier_rate(tier)
            return self._refuse(ticket, "queue_full", wait, max(one_place, wait - max(0.0, allowed)))
        # With nothing ahead, refusing helps no one: queueing is not what would be slow.
        if self._tiered and wait > 0 and wait > allowed:
            return self._refuse(ticket, "over_budget", wait, wait - max(0.0, allowed))
        self._enqueue(ticket, now)
        return Admission(True, "queued", wait)

    def _refuse(self, ticket: Ticket, reason: str, wait: float, retry_after: float) -> Admission:
        ticket.state = TicketState.REFUSED
        key = (ticket.tier, reason)
        self.counters.refused[key] = self.counters.refused.get(key, 0) + 1
        self.observer.refused(self.pool, ticket.tier, reason)
        retry = min(self.policy.max_retry_after_s, max(self.policy.min_retry_after_s, retry_after))
        return Admission(False, reason, wait, retry)

    def _enqueue(self, ticket: Ticket, now: float, front: bool = False) -> None:
        ticket.state = TicketState.QUEUED
        ticket.enqueued_at = now
        self._queue_for(ticket.tier).push(ticket, front=front)
        if math.isfinite(ticket.expires_at):
            # A fresh tie-breaker: a requeued ticket may have an older entry with equal time.
            heapq.heappush(self._expiry, (ticket.expires_at, next(self._seq), ticket))
            if len(self._expiry) > 2 * self.queued() + 64:
                self._compact_expiry()

    def _compact_expiry(self) -> None:
        queued = (t for q in (self._queues.values() if self._tiered else [self._fifo]) for t in q.tickets())
        self._expiry = [(t.expires_at, t.seq, t) for t in queued if math.isfinite(t.expires_at)]
        heapq.heapify(self._expiry)

    # ----- estimates ----------------------------------------------------------------------

    def _rate(self) -> float:
        """Slots released per second across the pool, from the measured hold time."""
        # A floor: streams that finish within the same clock tick must not divide by zero.
        return self.capacity / max(self._hold.value, 1e-3)

    def _share(self, tier: Tier) -> float:
        """Fraction of the non-S slot releases this tier gets now."""
        if tier == Tier.S or not self._tiered:
            return 1.0
        other = Tier.B if tier == Tier.A else Tier.A
        if not self._queues[other]:
            return 1.0
        a_share = self.policy.shares.a_share(self.load())
        return a_share if tier == Tier.A else 1.0 - a_share

    def _tier_rate(self, tier: Tier) -> float:
        rate = self._rate()
        return rate * self._share(tier) if rate > 0 else 1.0 / self.policy.max_retry_after_s

    def _preemptible(self, avoid: frozenset[str] = frozenset()) -> list[Ticket]:
        if not self._tiered:
            return []
        return [
            t
            for t in self._running
            if t.tier == Tier.B
            and not t.preempting
            and t.preemptions < self.policy.max_preemptions
            and t.worker_id not in avoid
        ]

    def estimated_wait(self, tier: Tier, tenant: str | None = None) -> float:
        """Seconds a new ticket of `tier` (and `tenant`) would wait for a slot; inf: no workers."""
        self.policy.spec(tier)
        rate = self._rate()
        if rate <= 0:
            return math.inf
        free = sum(self._free_slots().values())
        if not self._tiered:
            releases = len(self._fifo) + 1 - free
            return max(0, releases) / rate
        s_ahead = self._queues[Tier.S].ahead_for(tenant if tier == Tier.S else None)
        if tier == Tier.S:
            # A waiting S takes a B stream's slot instead of waiting for a release.
            releases = s_ahead + 1 - free - len(self._preemptible())
            return max(0, releases) / rate
        releases = s_ahead + self._queues[tier].ahead_for(tenant) + 1 - free
        if releases <= 0:
            return 0.0
        s_part = min(releases, s_ahead)
        return s_part / rate + (releases - s_part) / (rate * self._share(tier))

    # ----- dispatch -----------------------------------------------------------------------

    def expire(self, now: float | None = None) -> list[Ticket]:
        """Removes queued tickets past their wait limit; the caller refuses them."""
        now = self.clock() if now is None else now
        expired: list[Ticket] = []
        while self._expiry and self._expiry[0][0] <= now:
            ticket = heapq.heappop(self._expiry)[2]
            if ticket.state is not TicketState.QUEUED or ticket.expires_at > now:
                continue  # dispatched, cancelled, or requeued with a later limit
            self._queue_for(ticket.tier).remove(ticket)
            ticket.state = TicketState.EXPIRED
            self.counters.expired[ticket.tier] += 1
            self.observer.expired(self.pool, ticket.tier)
            expired.append(ticket)
        return expired

    def dispatch(self, workers: Mapping[str, WorkerSlots | tuple[int, int]] | None = None) -> DispatchPlan:
        """Assigns queued tickets to free worker slots; each started ticket holds one slot."""
        if workers is not None:
            self.observe_workers(workers)
        now = self.clock()
        expired = self.expire(now)
        started: list[tuple[Ticket, str]] = []
        free = self._free_slots()
        a_share = self.policy.shares.a_share(self.load())
        deferred: list[Ticket] = []
        while free and self.queued():
            ticket = self._pop_next(a_share)
            worker = self._choose_worker(ticket, free)
            if worker is None:
                # Every free slot is on a worker this ticket must avoid; others may still fit.
                deferred.append(ticket)
                continue
            self._start(ticket, worker, now)
            started.append((ticket, worker))
            free[worker] -= 1
            if free[worker] == 0:
                del free[worker]
        for ticket in reversed(deferred):
            self._queue_for(ticket.tier).push(ticket, front=True)
        return DispatchPlan(started, expired)

    def _pop_next(self, a_share: float) -> Ticket:
        if not self._tiered:
            return self._fifo.pop()
        if self._queues[Tier.S]:
            return self._queues[Tier.S].pop()
        a, b = self._queues[Tier.A], self._queues[Tier.B]
        if a and b:
            # Smooth weighted round robin: shares hold over any window, without bursts.
            self._credits[Tier.A] += a_share
            self._credits[Tier.B] += 1.0 - a_share
            pick = Tier.A if self._credits[Tier.A] >= self._credits[Tier.B] else Tier.B
            self._credits[pick] -= 1.0
            return self._queues[pick].pop()
        # A tier that is alone banks no credit for later.
        self._credits = {Tier.A: 0.0, Tier.B: 0.0}
        return (a or b).pop()

    def _choose_worker(self, ticket: Ticket, free: dict[str, int]) -> str | None:
        if ticket.prefer is not None and ticket.prefer in free and ticket.prefer not in ticket.avoid:
            return ticket.prefer
        best: str | None = None
        best_key = (-1.0, 0)
        # Start the scan at a rotating offset: equally free workers share the traffic
        # instead of the first one taking every request when the pool is idle.
        items = list(free.items())
        if items:
            self._rotation = (self._rotation + 1) % len(items)
            items = items[self._rotation :] + items[: self._rotation]
        for wid, n in items:
            if wid in ticket.avoid:
                continue
            key = (n / max(1, self._workers[wid].capacity) * self._ramp(wid), -self._local.get(wid, 0))
            if key > best_key:
                best, best_key = wid, key
        return best

    def _ramp(self, wid: str) -> float:
        """Share of a worker's free slots that counts while it is new to the pool (slow start)."""
        joined = self._joined_at.get(wid)
        window = self.policy.slow_start_s
        if joined is None or window <= 0:
            return 1.0
        return min(1.0, max(_SLOW_START_FLOOR, (self.clock() - joined) / window))

    def _start(self, ticket: Ticket, worker: str, now: float) -> None:
        ticket.state = TicketState.RUNNING
        ticket.worker_id = worker
        ticket.dispatched_at = now
        ticket.first_token_at = None
        ticket.preempting = False
        self._running[ticket] = None
        self._local[worker] = self._local.get(worker, 0) + 1
        wait = now - ticket.enqueued_at
        self.counters.dispatched[ticket.tier] += 1
        self.counters.wait_s_total[ticket.tier] += wait
        self.observer.queue_wait(self.pool, ticket.tier, wait)

    # ----- running tickets ----------------------------------------------------------------

    def on_first_token(self, ticket: Ticket) -> None:
        """Records dispatch-to-first-token once per dispatch (feeds the admission estimate)."""
        if ticket.state is TicketState.RUNNING and ticket.first_token_at is None and ticket.dispatched_at is not None:
            ticket.first_token_at = self.clock()
            self._first_token.add(ticket.first_token_at - ticket.dispatched_at)

    def on_finished(self, ticket: Ticket) -> bool:
        """Frees the slot of a request that completed; its hold time feeds the estimate."""
        if ticket.state is not TicketState.RUNNING:
            return False
        if ticket.dispatched_at is not None:
            self._hold.add(self.clock() - ticket.dispatched_at)
        self._release(ticket)
        ticket.state = TicketState.DONE
        self.counters.finished[ticket.tier] += 1
        return True

    def cancel(self, ticket: Ticket) -> bool:
        """Takes a ticket out wherever it is (queue or slot); safe to call more than once."""
        if ticket.state is TicketState.QUEUED:
            self._queue_for(ticket.tier).remove(ticket)
        elif ticket.state is TicketState.RUNNING:
            # A partial run says nothing about service time: no hold-time sample.
            self._release(ticket)
        elif ticket.state is not TicketState.NEW:
            return False
        ticket.state = TicketState.CANCELLED
        self.counters.cancelled[ticket.tier] += 1
        return True

    def _release(self, ticket: Ticket) -> None:
        self._running.pop(ticket, None)
        worker = ticket.worker_id
        if worker is not None:
            count = self._local.get(worker, 0) - 1
            if count <= 0:
                self._local.pop(worker, None)
            else:
                self._local[worker] = count
        ticket.preempting = False

    # ----- preemption ---------------------------------------------------------------------

    def preempt_candidate_for(self, ticket: Ticket) -> Ticket | None:
        """The running stream an S ticket may take the slot of: the youngest B one, if any."""
        if not self._tiered or ticket.tier != Tier.S:
            return None
        candidates = self._preemptible(ticket.avoid)
        if not candidates:
            return None
        # Youngest loses least work; among equals, the one with fewer tokens sent.
        return max(candidates, key=lambda t: (t.dispatched_at or 0.0, -t.tokens_generated, t.seq))

    def plan_preemptions(self) -> list[Ticket]:
        """Marks and returns B streams to stop, one per S ticket that no free slot can take.

        Preemptions already under way count against the waiting S tickets, so calling this
        after every event never asks more streams to yield than S needs.
        """
        if not self._tiered or not self._queues[Tier.S]:
            return []
        free = self._free_slots()
        waiting = sorted(self._queues[Tier.S].tickets(), key=lambda t: (t.deadline, t.seq))
        unserved: list[Ticket] = []
        for ticket in waiting:
            worker = self._choose_worker(ticket, free)
            if worker is None:
                unserved.append(ticket)
                continue
            free[worker] -= 1
            if free[worker] == 0:
                del free[worker]
        under_way = sum(1 for t in self._running if t.preempting)
        victims: list[Ticket] = []
        for ticket in unserved[under_way:]:
            victim = self.preempt_candidate_for(ticket)
            if victim is None:
                continue
            victim.preempting = True
            self.counters.preempted[victim.tier] += 1
            self.observer.preempted(self.pool, victim.tier)
            victims.append(victim)
        return victims

    def requeue_preempted(self, ticket: Ticket) -> bool:
        """Frees a preempted stream's slot and queues it again, keeping its tokens.

        Returns False (ticket expired) when its client deadline leaves no time to wait.
        Requeued tickets may exceed the queue bound by at most the pool's running count.
        """
        if ticket.state is not TicketState.RUNNING:
            return False
        self._release(ticket)
        ticket.preemptions += 1
        return self._requeue(ticket)

    def requeue_failed(self, ticket: Ticket) -> bool:
        """Puts a ticket whose worker failed back in front of its queue, avoiding that worker."""
        if ticket.state is not TicketState.RUNNING:
            return False
        self._release(ticket)
        if ticket.worker_id is not None:
            ticket.avoid = ticket.avoid | {ticket.worker_id}
        return self._requeue(ticket)

    def _requeue(self, ticket: Ticket) -> bool:
        now = self.clock()
        self.counters.requeued[ticket.tier] += 1
        # A requeued ticket was admitted and its client may be mid-stream: refusing it now
        # would break that stream, so it waits as long as its client deadline allows.
        expires_at = math.inf
        if ticket.client_deadline is not None:
            expires_at = min(expires_at, ticket.client_deadline)
        ticket.expires_at = expires_at
        if expires_at <= now:
            ticket.state = TicketState.EXPIRED
            self.counters.expired[ticket.tier] += 1
            self.observer.expired(self.pool, ticket.tier)
            return False
        # It keeps its original deadline, so it comes before newer work of its tier.
        self._enqueue(ticket, now, front=True)
        return True

    # ----- metrics ------------------------------------------------------------------------

    def snapshot(self) -> PoolSnapshot:
        now = self.clock()
        tiers: dict[Tier, TierSnapshot] = {}
        for tier in TIERS:
            queued = [t for t in self._queue_for(tier).tickets() if t.tier == tier]
            oldest = max((now - t.enqueued_at for t in queued), default=0.0)
            tiers[tier] = TierSnapshot(len(queued), self.running(tier), oldest, self.estimated_wait(tier))
        free = self._free_slots()
        load = self.load()
        return PoolSnapshot(
            pool=self.pool,
            mode=self.policy.mode,
            tiers=tiers,
            capacity=self.capacity,
            free_slots=sum(free.values()),
            load=load,
            a_share=self.policy.shares.a_share(load),
            hold_s=self._hold.value,
            first_token_s=self._first_token.value,
            preempting=sum(1 for t in self._running if t.preempting),
        )
