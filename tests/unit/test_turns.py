"""Agent turn outcomes and the sliding-window success rate, as the router exports them."""

from __future__ import annotations

import asyncio

import pytest

from services.common.config import TelemetryConfig
from services.common.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from services.common.telemetry import Telemetry
from services.router.turns import SlidingWindowRate, TurnMetrics, TurnOutcome, classify_turn
from tests.unit.fake_clock import FakeClock


@pytest.mark.parametrize(
    "error, finished, structured_failed, deadline_passed, outcome",
    [
        (None, True, False, False, TurnOutcome.SUCCESS),
        (None, True, True, False, TurnOutcome.FORMAT_ERROR),
        (None, False, False, False, TurnOutcome.ERROR),
        (DeadlineExceeded("late"), False, False, True, TurnOutcome.TIMEOUT),
        (asyncio.CancelledError(), False, False, True, TurnOutcome.TIMEOUT),  # the client's deadline
        (asyncio.CancelledError(), False, False, False, TurnOutcome.CANCELLED),
        (ResourceExhausted("full"), False, False, False, TurnOutcome.REFUSED),
        (Unavailable("no worker"), False, False, False, TurnOutcome.ERROR),
        (InvalidArgument("bad"), False, False, False, TurnOutcome.REJECTED),
        (NotFound("model"), False, False, False, TurnOutcome.REJECTED),
        (RuntimeError("bug"), False, False, False, TurnOutcome.ERROR),
    ],
)
def test_classify_turn(error, finished, structured_failed, deadline_passed, outcome):
    assert classify_turn(error, finished, structured_failed, deadline_passed) is outcome


def test_only_outcomes_the_service_answers_for_count_in_the_rate():
    assert {o for o in TurnOutcome if not o.counts_in_rate} == {TurnOutcome.CANCELLED, TurnOutcome.REJECTED}


def test_window_rate_slides_and_forgets_old_turns():
    clock = FakeClock(1000.0)
    window = SlidingWindowRate(window_s=60, buckets=6, clock=clock)
    assert window.rate() is None
    for success in (True, True, True, False):
        window.record(success)
    assert window.rate() == 0.75
    clock.advance(30)
    window.record(False)
    assert window.rate() == 0.6
    clock.advance(40)  # the first four are now older than the window
    assert window.rate() == 0.0
    clock.advance(600)
    assert window.rate() is None
    window.record(True)
    assert window.rate() == 1.0


def test_window_memory_is_bounded_by_its_buckets():
    clock = FakeClock(1000.0)
    window = SlidingWindowRate(window_s=10, buckets=5, clock=clock)
    for _ in range(10_000):
        window.record(True)
        clock.advance(0.01)
    assert len(window._buckets) == 5 and window.rate() == 1.0


def _samples(telemetry: Telemetry, name: str) -> dict[str, float]:
    values = {}
    for line in telemetry.render().splitlines():
        if line.startswith(name):
            series, value = line.rsplit(" ", 1)
            values[series] = float(value)
    return values


def test_turn_metrics_export_the_counter_pair_and_the_rate():
    telemetry = Telemetry("router", TelemetryConfig(enabled=False))
    try:
        turns = TurnMetrics(telemetry.meter)
        assert _samples(telemetry, "ballast_agent_turn_success_rate") == {}  # no turn yet: no value
        for outcome in (
            TurnOutcome.SUCCESS,
            TurnOutcome.SUCCESS,
            TurnOutcome.SUCCESS,
            TurnOutcome.FORMAT_ERROR,
            TurnOutcome.CANCELLED,
            TurnOutcome.REJECTED,
        ):
            turns.record(outcome, "tiny")
        counters = _samples(telemetry, "ballast_agent_turns_total")
        assert counters['ballast_agent_turns_total{model="tiny",outcome="success"}'] == 3
        assert counters['ballast_agent_turns_total{model="tiny",outcome="format_error"}'] == 1
        assert counters['ballast_agent_turns_total{model="tiny",outcome="cancelled"}'] == 1
        assert _samples(telemetry, "ballast_agent_turn_success_rate") == {"ballast_agent_turn_success_rate": 0.75}
    finally:
        telemetry.stop()
