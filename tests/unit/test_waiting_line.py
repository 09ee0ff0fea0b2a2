"""Where a request stood in a lost worker's line (services.router.scheduling.waiting_line):
behind requests sent before it of its tier or a more urgent one (a resumed stream a tier
ahead), counting only those without their first token; requests lost with the worker before
it read its place still stand ahead of it, until the worker relays a token again; bounded."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.tier import Tier
from services.router.scheduling.waiting_line import LostLines


@dataclass(eq=False)
class Request:
    name: str
    dispatched_at: float | None
    tier: Tier = Tier.A
    first_token_at: float | None = None
    tokens_generated: int = 0


class Worker:
    """The requests running on one worker, as the scheduler lists them."""

    def __init__(self, *requests: Request) -> None:
        self.running = list(requests)

    def leave(self, request: Request) -> None:
        self.running.remove(request)

    def on_it(self) -> list[Request]:
        return list(self.running)


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_request_stands_behind_those_sent_before_it_of_its_tier_or_a_more_urgent_one():
    a1, a2, a3 = Request("a1", 1.0), Request("a2", 2.0), Request("a3", 3.0)
    streaming = Request("streaming", 0.5, first_token_at=0.7)
    urgent_early = Request("s-early", 1.5, Tier.S)
    urgent_late = Request("s-late", 2.5, Tier.S)  # came after a1 and a2: it displaces neither
    low = Request("b", 0.1, Tier.B)
    resumed = Request("resumed-b", 2.2, Tier.B, tokens_generated=4)  # scheduled as A
    worker = Worker(a1, a2, a3, streaming, urgent_early, urgent_late, low, resumed)
    lines = LostLines(Clock())
    places = {r.name: lines.waiting_ahead("w1", r, worker.on_it, None) for r in worker.on_it()}
    assert places == {
        "s-early": 0,
        "s-late": 1,
        "a1": 0,
        "a2": 2,  # a1, s-early
        "a3": 5,  # a1, a2, s-early, s-late, resumed-b
        "b": 0,
        "resumed-b": 3,  # a1, a2, s-early
        "streaming": 0,  # had its first token: ahead of no one, and nothing counts against it
    }


def test_requests_that_left_the_worker_first_still_stand_ahead_in_the_line():
    """The requests lost with a worker give their slots up one at a time: read live, the line
    would shorten under the last of them and put it at the head."""
    head, second, last = Request("head", 1.0), Request("second", 2.0), Request("last", 3.0)
    worker = Worker(head, second, last)
    lines = LostLines(Clock())
    assert lines.waiting_ahead("w1", head, worker.on_it, 0.5) == 0
    worker.leave(head)
    assert lines.waiting_ahead("w1", second, worker.on_it, 0.5) == 1
    worker.leave(second)
    assert lines.waiting_ahead("w1", last, worker.on_it, 0.5) == 2


def test_once_the_worker_streams_again_the_requests_lost_before_stand_in_no_line():
    """A stalled worker that came back served its line; a request that strikes it later is
    placed in the line of that later moment, not behind requests lost in the stall."""
    clock = Clock(100.0)
    first, second, third = Request("first", 1.0), Request("second", 2.0), Request("third", 3.0)
    worker = Worker(first, second, third)
    lines = LostLines(clock)
    assert lines.waiting_ahead("w1", first, worker.on_it, 50.0) == 0
    worker.leave(first)
    second.first_token_at = 110.0  # the worker streams again; `second` is served
    poison = Request("poison", 4.0)
    worker.running.append(poison)
    clock.now = 120.0
    # Only `third` still waits ahead of it: `first` was lost before the worker's last token.
    assert lines.waiting_ahead("w1", poison, worker.on_it, 110.0) == 1


def test_a_request_sent_again_to_the_same_worker_is_placed_by_its_new_dispatch():
    ahead, request = Request("ahead", 1.0), Request("request", 2.0)
    worker = Worker(ahead, request)
    lines = LostLines(Clock())
    assert lines.waiting_ahead("w1", request, worker.on_it, None) == 1
    request.dispatched_at = 0.5  # sent again, before `ahead` was
    assert lines.waiting_ahead("w1", request, worker.on_it, None) == 0


def test_lines_are_kept_per_worker_and_bounded():
    lines = LostLines(Clock(), max_lines=2, max_lost=3)
    for index in range(4):
        worker = Worker(*(Request(f"r{index}-{i}", float(i)) for i in range(5)))
        for request in worker.on_it():
            lines.waiting_ahead(f"w{index}", request, lambda: [], None)
    assert len(lines) == 2
    # Only the latest three lost on w3 are remembered.
    late = Request("late", 10.0)
    assert lines.waiting_ahead("w3", late, lambda: [], None) == 3
