"""Where a request stood in a lost worker's line (services.router.scheduling.waiting_line):
by tier, then by dispatch; only requests without their first token count; the line is taken
at the first loss handled, so the requests that gave their slots up before the others read
theirs still count; a request dispatched during the loss extends the line, one after it
ends finds a new line."""

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


class Worker:
    """The requests running on one worker, as the scheduler lists them."""

    def __init__(self, *requests: Request) -> None:
        self.running = list(requests)

    def leave(self, request: Request) -> None:
        self.running.remove(request)

    def on_it(self) -> list[Request]:
        return list(self.running)


def test_the_line_runs_by_tier_then_dispatch_and_counts_only_requests_without_a_token():
    a1, a2, a3 = Request("a1", 1.0), Request("a2", 2.0), Request("a3", 3.0)
    streaming = Request("streaming", 0.5, first_token_at=0.7)
    urgent = Request("s", 2.5, Tier.S)
    low = Request("b", 0.1, Tier.B)
    worker = Worker(a1, a2, a3, streaming, urgent, low)
    lines = LostLines()
    places = {r.name: lines.waiting_ahead("w1", r, worker.on_it) for r in worker.on_it()}
    # S before every A, A by dispatch, B last; the streaming request is ahead of no one.
    assert places == {"s": 0, "a1": 1, "a2": 2, "a3": 3, "b": 4, "streaming": 0}
    assert len(lines) == 0  # every request read its place: the line is dropped


def test_requests_that_left_the_worker_first_still_stand_ahead_in_the_line():
    """The requests lost with a worker give their slots up one at a time: read live, the line
    would shorten under the last of them and put it at the head."""
    head, second, last = Request("head", 1.0), Request("second", 2.0), Request("last", 3.0)
    worker = Worker(head, second, last)
    lines = LostLines()
    assert lines.waiting_ahead("w1", head, worker.on_it) == 0
    worker.leave(head)
    assert lines.waiting_ahead("w1", second, worker.on_it) == 1
    worker.leave(second)
    assert lines.waiting_ahead("w1", last, worker.on_it) == 2
    assert len(lines) == 0


def test_a_request_dispatched_while_the_loss_goes_on_joins_the_end_of_the_line():
    early, waiting = Request("early", 1.0), Request("waiting", 2.0)
    worker = Worker(early, waiting)
    lines = LostLines()
    assert lines.waiting_ahead("w1", early, worker.on_it) == 0
    worker.leave(early)
    # A stalled worker's requests notice one by one; one sent to it meanwhile stands behind.
    late = Request("late", 3.0)
    worker.running.append(late)
    assert lines.waiting_ahead("w1", late, worker.on_it) == 2
    assert lines.waiting_ahead("w1", waiting, worker.on_it) == 1


def test_after_the_loss_ends_a_new_loss_of_the_same_worker_takes_a_new_line():
    """A stalled worker that came back served its line; a request that strikes it later is
    placed in the line of that later moment, not behind requests long served."""
    first, second = Request("first", 1.0), Request("second", 2.0)
    worker = Worker(first, second)
    lines = LostLines()
    assert lines.waiting_ahead("w1", first, worker.on_it) == 0
    worker.leave(first)
    second.first_token_at = 2.5  # the worker streams again: `second` never reads its place
    poison = Request("poison", 4.0)
    worker.running.append(poison)
    assert lines.waiting_ahead("w1", poison, worker.on_it) == 0


def test_a_request_sent_again_to_the_same_worker_is_placed_by_its_new_dispatch():
    ahead, request = Request("ahead", 1.0), Request("request", 2.0)
    worker = Worker(ahead, request)
    lines = LostLines()
    lines.waiting_ahead("w1", ahead, worker.on_it)
    request.dispatched_at = 0.5  # its old dispatch ended; this one came before `ahead`'s
    assert lines.waiting_ahead("w1", request, worker.on_it) == 0


def test_lines_are_kept_per_worker_and_bounded():
    lines = LostLines(max_lines=2)
    for index in range(4):
        unread = Request(f"unread-{index}", 1.0)
        reader = Request(f"reader-{index}", 2.0)
        worker = Worker(unread, reader)
        assert lines.waiting_ahead(f"w{index}", reader, worker.on_it) == 1
    assert len(lines) == 2
