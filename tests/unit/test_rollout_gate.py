"""The SLO gate on a simulated clock: promotion after a clean window, rollback on a breach."""

from __future__ import annotations

from services.router.rollout.gate import SloGate, Verdict, p99
from services.router.rollout.state import GatePolicy

POLICY = GatePolicy(window_s=60.0, min_requests=20, max_error_rate=0.05, max_p99_ms=500.0, breach_min_requests=5)


def feed(
    gate: SloGate, start: float, count: int, every_s: float = 1.0, latency_ms: float = 100.0, fail_every: int = 0
) -> float:
    now = start
    for i in range(count):
        failed = fail_every > 0 and i % fail_every == fail_every - 1
        gate.record(now, ok=not failed, latency_ms=latency_ms)
        now += every_s
    return now


def test_a_clean_window_with_enough_requests_promotes():
    gate = SloGate(POLICY, started_at=0.0)
    now = feed(gate, 0.0, 30, every_s=1.0)
    assert gate.reading(now).verdict is Verdict.HOLD  # 30 s in: the window is not over yet
    now = feed(gate, now, 31, every_s=1.0)
    reading = gate.reading(now)
    assert reading.verdict is Verdict.PROMOTE
    assert reading.errors == 0 and reading.p99_ms == 100.0
    assert "clean window" in reading.reason


def test_too_few_requests_never_promote():
    gate = SloGate(POLICY, started_at=0.0)
    feed(gate, 0.0, 10, every_s=10.0)
    assert gate.reading(600.0).verdict is Verdict.HOLD


def test_an_error_rate_breach_rolls_back_at_once():
    gate = SloGate(POLICY, started_at=0.0)
    now = feed(gate, 0.0, 4, every_s=0.1)
    gate.record(now, ok=False)
    reading = gate.reading(now)
    assert reading.verdict is Verdict.ROLLBACK  # 1 of 5 = 20 %, long before the window ends
    assert reading.errors == 1 and "error rate" in reading.reason


def test_a_few_early_errors_before_the_minimum_do_not_count_as_a_breach():
    gate = SloGate(POLICY, started_at=0.0)
    gate.record(0.0, ok=False)
    gate.record(0.1, ok=False)
    assert gate.reading(0.2).verdict is Verdict.HOLD


def test_a_p99_breach_rolls_back():
    gate = SloGate(POLICY, started_at=0.0)
    now = feed(gate, 0.0, 10, every_s=0.1, latency_ms=100.0)
    now = feed(gate, now, 1, latency_ms=900.0)
    reading = gate.reading(now)
    assert reading.verdict is Verdict.ROLLBACK
    assert reading.p99_ms == 900.0 and "p99" in reading.reason


def test_old_samples_leave_the_window():
    gate = SloGate(POLICY, started_at=0.0)
    feed(gate, 0.0, 5, every_s=0.1, fail_every=1)
    assert gate.reading(1.0).verdict is Verdict.ROLLBACK
    # Two windows later the failures are forgotten; a clean run then promotes.
    now = feed(gate, 200.0, 25, every_s=1.0)
    reading = gate.reading(now)
    assert reading.errors == 0 and reading.verdict is Verdict.PROMOTE


def test_an_error_rate_at_the_limit_is_not_a_breach():
    gate = SloGate(POLICY, started_at=0.0)
    now = feed(gate, 0.0, 60, every_s=1.0, fail_every=20)  # 3 of 60 = exactly 5 %
    reading = gate.reading(now)
    assert reading.error_rate == 0.05 and reading.verdict is Verdict.PROMOTE


def test_samples_are_bounded():
    gate = SloGate(POLICY, started_at=0.0, max_samples=50)
    feed(gate, 0.0, 500, every_s=0.01)
    assert gate.reading(5.0).requests == 50


def test_p99_is_nearest_rank():
    assert p99([]) is None
    assert p99([5.0]) == 5.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0
