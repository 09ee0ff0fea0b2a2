"""The event loop's lag window and the engine's step gaps: the bookkeeping behind
ballast_event_loop_lag_worst_ms, ballast_worker_engine_step_gap and their warnings."""

from __future__ import annotations

import pytest

from services.common.loop_lag import LagWindow
from services.worker.engine_watch import WARN_EVERY_S, StepGaps


class TestLagWindow:
    def test_worst_is_the_largest_lag_still_in_the_window(self):
        window = LagWindow(window_s=60, warn_ms=1000)
        window.record(5, now=0)
        window.record(300, now=10)
        window.record(20, now=20)
        assert window.worst_ms(now=30) == 300
        # The 300 ms lag leaves the window; the 20 ms one is the worst left.
        assert window.worst_ms(now=71) == 20
        assert window.worst_ms(now=200) == 0

    def test_a_later_larger_lag_replaces_earlier_smaller_ones(self):
        window = LagWindow(window_s=60, warn_ms=1000)
        for now, lag in enumerate([50, 40, 30, 90]):
            window.record(lag, now=now)
        assert window.worst_ms(now=4) == 90
        assert window.worst_ms(now=63.5) == 0

    def test_lags_under_the_threshold_are_not_logged(self):
        window = LagWindow(window_s=60, warn_ms=1000)
        assert all(window.record(lag, now=i) is None for i, lag in enumerate([0, 10, 999]))

    def test_one_warning_a_window_counting_the_lags_it_stands_for(self):
        window = LagWindow(window_s=60, warn_ms=1000)
        first = window.record(2500, now=0)
        assert first is not None and "2.5 s late" in first and "(1 lag(s)" in first
        assert window.record(1200, now=10) is None
        assert window.record(1500, now=59) is None
        later = window.record(1100, now=61)
        assert later is not None and "(3 lag(s)" in later


class TestStepGaps:
    def test_gap_is_the_time_between_readings_at_which_the_count_moved(self):
        gaps = StepGaps(warn_s=5)
        assert gaps.read(steps=10, in_flight=1, now=0.0) is None  # busy from here
        assert gaps.read(steps=11, in_flight=1, now=0.25) == pytest.approx(0.25)
        assert gaps.read(steps=11, in_flight=1, now=0.5) is None
        assert gaps.read(steps=11, in_flight=1, now=6.0) is None
        assert gaps.stalled_s(now=6.5) == pytest.approx(6.25)
        assert gaps.read(steps=12, in_flight=1, now=7.0) == pytest.approx(6.75)
        assert gaps.stalled_s(now=7.0) == 0

    def test_an_idle_engine_is_no_stall(self):
        gaps = StepGaps(warn_s=5)
        gaps.read(steps=3, in_flight=0, now=0.0)
        gaps.read(steps=3, in_flight=0, now=100.0)
        assert gaps.stalled_s(now=100.0) == 0
        # A request arriving after a long idle time starts its wait when it arrives.
        assert gaps.read(steps=3, in_flight=1, now=100.25) is None
        assert gaps.read(steps=4, in_flight=1, now=100.5) == pytest.approx(0.25)

    def test_requests_gone_without_a_step_end_the_wait_unrecorded(self):
        gaps = StepGaps(warn_s=5)
        gaps.read(steps=3, in_flight=2, now=0.0)
        assert gaps.read(steps=3, in_flight=0, now=9.0) is None
        assert gaps.stalled_s(now=9.5) == 0
        assert gaps.read(steps=3, in_flight=1, now=10.0) is None
        assert gaps.read(steps=4, in_flight=1, now=10.5) == pytest.approx(0.5)

    def test_long_gaps_warn_once_a_minute_with_their_count(self):
        gaps = StepGaps(warn_s=5)
        assert gaps.warning(4.9, now=0) is None
        first = gaps.warning(6.0, now=1)
        assert first is not None and "6.0 s" in first and "(1 gap(s)" in first
        assert gaps.warning(7.0, now=2) is None
        later = gaps.warning(5.0, now=1 + WARN_EVERY_S)
        assert later is not None and "(2 gap(s)" in later
