"""Where a request stood in its worker's line when the worker was lost: how many of this
router's requests were waiting ahead of it for their first token.

An engine prefills a few requests at a time, by priority and then by arrival (vLLM under
priority scheduling, the sim's slots); the others wait. A worker that dies or stalls while a
request is in prefill may have been killed by it (a query of death). A request that still
waited behind a full prefill batch had not reached the engine's prefill, so the loss says
nothing against it (see services.router.resilience.quarantine). The router sees only its own
requests: the line it counts is never longer than the engine's, so a request it finds
queued was queued.

The requests lost with a worker handle the loss one at a time, and each gives its slot up as
it does, so the line read live would shorten under the later ones. It is therefore taken
once, at the first loss handled on the worker, for every request then running there. Each
request reads its own place from that line, and the line is dropped once all have read it. A
request that is not in the line (dispatched after it was taken) extends it while the loss
goes on (some request of the line still waits for its first token: a stalled worker's
requests notice the stall one by one); otherwise the worker is lost again, and a new line is
taken.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterable, Protocol

from services.common.tier import TIER_ORDER, Tier

# How many workers' lines are held at most (each until its requests have read it; a worker
# that recovered leaves a line some requests never read).
MAX_LINES = 64


class InLine(Protocol):
    """A request running on a worker, as the scheduler's tickets are."""

    @property
    def tier(self) -> Tier: ...

    @property
    def dispatched_at(self) -> float | None: ...

    @property
    def first_token_at(self) -> float | None: ...


def line_key(request: InLine) -> tuple[int, float]:
    """The order an engine takes its waiting requests in: the more urgent tier first, then
    the earlier arrival."""
    rank = TIER_ORDER.index(request.tier) if request.tier in TIER_ORDER else len(TIER_ORDER)
    return rank, request.dispatched_at or 0.0


class _Line:
    """A worker's line when it was lost: the waiting requests' keys, in order, and the
    requests that have not read their place yet (with the dispatch they were taken in)."""

    __slots__ = ("keys", "unread")

    def __init__(self) -> None:
        self.keys: list[tuple[int, float]] = []
        self.unread: dict[InLine, float | None] = {}

    def holds(self, request: InLine) -> bool:
        return request in self.unread and self.unread[request] == request.dispatched_at

    def goes_on(self, running: list[InLine]) -> bool:
        """Whether the loss this line was taken for goes on: a request of it still runs on
        the worker, in the same dispatch, waiting for its first token."""
        return any(self.holds(r) and r.first_token_at is None for r in running)

    def extend(self, running: list[InLine]) -> None:
        for request in running:
            if request.dispatched_at is None or self.holds(request):
                continue
            self.unread[request] = request.dispatched_at
            if request.first_token_at is None:
                bisect.insort(self.keys, line_key(request))

    def ahead_of(self, request: InLine) -> int:
        return bisect.bisect_left(self.keys, line_key(request))


class LostLines:
    """The lines of lost workers, each until its requests have read their places."""

    def __init__(self, max_lines: int = MAX_LINES) -> None:
        self._lines: dict[str, _Line] = {}
        self._max = max_lines

    def waiting_ahead(self, worker: str, request: InLine, running_on: Callable[[], Iterable[InLine]]) -> int:
        """How many requests on `worker` waited for their first token ahead of `request` when
        the worker was lost. Call it for every request on the worker whose attempt ended with
        the worker's loss (streaming or not), before it gives its slot up; `running_on` lists
        the requests running on the worker now."""
        line = self._lines.get(worker)
        if line is None or not line.holds(request):
            running = list(running_on())
            if line is None or not line.goes_on(running):
                line = _Line()
            line.extend(running)
            self._lines.pop(worker, None)
            self._lines[worker] = line
            while len(self._lines) > self._max:
                del self._lines[next(iter(self._lines))]
        ahead = line.ahead_of(request) if request.first_token_at is None else 0
        line.unread.pop(request, None)
        if not line.unread:
            del self._lines[worker]
        return ahead

    def __len__(self) -> int:
        return len(self._lines)
