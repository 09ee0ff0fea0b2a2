"""Benchmark goals are judged in code, on the median of repeated runs, and the report shows
each verdict with the commit it ran on. Pure: no benchmark is run."""

from __future__ import annotations

import math

import pytest

from bench.goals import HIGHER, LOWER, Goal, judge
from bench.report import render


def test_a_repeated_metric_is_judged_on_its_median_with_its_range():
    judged = judge([Goal("p99", "p99_ms", 300, LOWER, " ms")], {"p99_ms": [250.0, 900.0, 280.0]})
    (goal,) = judged["goals"]
    assert goal["value"] == 280.0 and (goal["min"], goal["max"], goal["runs"]) == (250.0, 900.0, 3)
    assert goal["met"] and goal["margin"] == 20.0 and judged["met"]


def test_a_missed_or_unmeasured_goal_fails_the_benchmark():
    judged = judge([Goal("ratio", "ratio", 0.9, HIGHER), Goal("lost", "lost", 0, LOWER)], {"ratio": 0.8})
    ratio, lost = judged["goals"]
    assert not ratio["met"] and ratio["margin"] == pytest.approx(-0.1)
    assert not lost["met"] and math.isnan(lost["value"])
    assert not judged["met"]
    with pytest.raises(ValueError):
        Goal("x", "x", 1, "sideways")


def test_the_report_lists_every_goal_with_its_verdict_and_commit(tmp_path):
    judged = judge([Goal("added TTFT p99", "added", 3.0, LOWER, " ms")], {"added": [2.0, 4.0, 5.0]})
    results = {
        "overhead": {**judged, "commit": {"sha": "abc123def4567", "dirty": True}, "written_at": "2026-12-01T00:00:00Z"},
        "context": {"commit": {"sha": "0123456789ab", "dirty": False}},
        "tiers": {**judged, "commit": {"sha": "feedfacecafe", "dirty": False}, "written_at": "2026-12-02T00:00:00Z"},
    }
    older = {"0123456789ab"}
    text = render(results, tmp_path, changed_since=lambda sha, _paths: sha in older)
    assert (
        "| overhead | added TTFT p99 | 4 ms (2..5, 3 runs) | <= 3 ms | **missed** | abc123def4+dirty | uncommitted |"
        in text
    )
    assert "| tiers | added TTFT p99 | 4 ms (2..5, 3 runs) | <= 3 ms | **missed** | feedfaceca | current |" in text
    assert "`context` (0123456789, **older code**)" in text
