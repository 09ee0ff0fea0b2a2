"""Where a request stood in its worker's line when the worker was lost: how many of this
router's requests were waiting ahead of it for their first token.

An engine takes its waiting requests by priority and then by arrival (vLLM under priority
scheduling, the sim's slots) and prefills a few at a time. A worker that dies or stalls while
a request is in prefill may have been killed by it (a query of death); a request that still
waited behind a full prefill batch had most likely not reached the prefill (see
services.router.resilience.quarantine, which bounds how often that excuse is taken). The
router sees only its own requests, so the line it counts is never longer than the engine's.

A request stands behind another when the other was sent to the worker before it and is
scheduled at least as early: the same tier or a more urgent one (a resumed stream runs one
tier ahead, as the engines schedule it). A later arrival of a more urgent tier is not counted:
it would not displace a request the engine had already begun.

The requests lost with a worker handle the loss one at a time, and each gives its slot up as
it does, so the line read from the running requests alone would shorten under the later ones.
Each request lost while waiting is therefore remembered, with when it was lost, and stands in
the line of every request of the same loss that reads its place after it. A loss is the same
one while the worker stays silent: once it relays a token again (a stall that ended), the
requests lost before no longer stand in anyone's line.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, NamedTuple, Protocol

from services.common.tier import TIER_ORDER, Tier

# Workers whose lost requests are remembered at most (a worker restarted under a new lease
# is a new line; the old one goes with the oldest), and lost requests per worker.
MAX_LINES = 64
MAX_LOST_PER_LINE = 1024


class InLine(Protocol):
    """A request running on a worker, as the scheduler's tickets are."""

    @property
    def tier(self) -> Tier: ...

    @property
    def dispatched_at(self) -> float | None: ...

    @property
    def first_token_at(self) -> float | None: ...

    @property
    def tokens_generated(self) -> int: ...


class Place(NamedTuple):
    """A waiting request's place: how early its engine schedules it, and when it was sent."""

    rank: int
    dispatched_at: float


def place_of(request: InLine) -> Place:
    """The order an engine takes waiting requests in: the more urgent tier first (a resumed
    stream one tier ahead of its own), then the earlier arrival."""
    rank = TIER_ORDER.index(request.tier) if request.tier in TIER_ORDER else len(TIER_ORDER)
    if request.tokens_generated:
        rank -= 1
    return Place(rank, request.dispatched_at or 0.0)


def stands_ahead(other: Place, request: Place) -> bool:
    return other.dispatched_at < request.dispatched_at and other.rank <= request.rank


def _identity(request: InLine) -> tuple[int, float | None]:
    # One dispatch of one request: a request sent again is another entry of the line.
    return id(request), request.dispatched_at


class LostLines:
    """The requests lost while waiting on each worker, for the places of the others lost
    with them. `clock` must be the one that dates the worker's last token (monotonic)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_lines: int = MAX_LINES,
        max_lost: int = MAX_LOST_PER_LINE,
    ) -> None:
        self._clock = clock
        self._max_lines = max_lines
        self._max_lost = max_lost
        # worker slot key -> {one dispatch of a lost request: (its place, when it was lost)}
        self._lost: dict[str, dict[tuple[int, float | None], tuple[Place, float]]] = {}

    def waiting_ahead(
        self,
        worker: str,
        request: InLine,
        running_on: Callable[[], Iterable[InLine]],
        last_token_at: float | None,
    ) -> int:
        """How many requests waited for their first token ahead of `request` on `worker` when
        the worker was lost (0 for a request that had its first token). Call it for every
        request whose attempt ended with the worker's loss, before it gives its slot up;
        `running_on` lists the requests running on the worker now, and `last_token_at` is
        when the worker last relayed a token to anyone (None: never)."""
        lost = self._lost.pop(worker, {})
        if last_token_at is not None:
            lost = {key: entry for key, entry in lost.items() if entry[1] >= last_token_at}
        me = _identity(request)
        waiting = {
            _identity(other): place_of(other)
            for other in running_on()
            if other.first_token_at is None and other.dispatched_at is not None
        }
        waiting.update((key, place) for key, (place, _) in lost.items())
        waiting.pop(me, None)
        ahead = 0
        if request.first_token_at is None and request.dispatched_at is not None:
            mine = place_of(request)
            ahead = sum(1 for place in waiting.values() if stands_ahead(place, mine))
            lost[me] = (mine, self._clock())
            while len(lost) > self._max_lost:
                del lost[next(iter(lost))]
        if lost:
            self._lost[worker] = lost
            while len(self._lost) > self._max_lines:
                del self._lost[next(iter(self._lost))]
        return ahead

    def __len__(self) -> int:
        return len(self._lost)
