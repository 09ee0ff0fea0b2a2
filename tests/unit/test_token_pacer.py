"""TokenPacer: which tokens of a relayed request wait for its next ones, on a clock the test moves."""

from __future__ import annotations

from services.worker.relay import TokenPacer


class Clock:
    """Stands in for the event loop's clock: the pacer reads nothing else of the loop."""

    def __init__(self) -> None:
        self.now = 100.0

    def time(self) -> float:
        return self.now


def _pacer(interval_s: float) -> tuple[TokenPacer, Clock]:
    clock = Clock()
    return TokenPacer(interval_s, clock), clock  # type: ignore[arg-type]


def test_the_first_tokens_never_wait():
    pacer, _clock = _pacer(0.05)
    assert pacer.hold_s() == 0.0


def test_tokens_close_behind_the_ones_before_wait_for_the_interval():
    pacer, clock = _pacer(0.05)
    pacer.hold_s()
    clock.now += 0.01
    assert pacer.hold_s() == 0.05
    clock.now += 0.049
    assert pacer.hold_s() == 0.05


def test_tokens_further_apart_than_the_interval_leave_as_they_come():
    # An engine step slower than the interval: holding would merge nothing with the next
    # tokens and only move the write into a wake-up of its own.
    pacer, clock = _pacer(0.05)
    pacer.hold_s()
    for _ in range(3):
        clock.now += 0.08
        assert pacer.hold_s() == 0.0


def test_the_gap_is_measured_from_the_tokens_just_before():
    # Binary fractions: the clock's sums are exact, so "exactly the interval" is exact.
    pacer, clock = _pacer(0.0625)
    pacer.hold_s()
    clock.now += 0.25  # a slow step: sent at once
    assert pacer.hold_s() == 0.0
    clock.now += 0.015625  # the engine sped up: held again
    assert pacer.hold_s() == 0.0625
    clock.now += 0.0625  # exactly the interval apart: nothing to merge with
    assert pacer.hold_s() == 0.0


def test_no_interval_never_holds():
    pacer, clock = _pacer(0.0)
    for _ in range(3):
        assert pacer.hold_s() == 0.0
        clock.now += 0.001
