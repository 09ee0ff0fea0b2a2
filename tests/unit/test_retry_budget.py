"""Retry budget: a share of requests plus a per-second floor, over a sliding window."""

import pytest
from pydantic import ValidationError

from services.common.errors import RetryBudgetExhausted, Unavailable
from services.router.resilience.retry_budget import (
    Refusal,
    RetryBudget,
    RetryBudgetConfig,
)
from tests.unit.fake_clock import FakeClock


def drain(budget: RetryBudget) -> int:
    granted = 0
    while budget.try_acquire():
        granted += 1
        assert granted < 10_000
    return granted


def test_quiet_router_gets_the_minimum_allowance():
    budget = RetryBudget(RetryBudgetConfig(min_retries_per_s=0.5, window_s=10), FakeClock(500.0))
    assert drain(budget) == 5


def test_allowance_grows_with_requests():
    budget = RetryBudget(RetryBudgetConfig(ratio=0.2, min_retries_per_s=0), FakeClock(500.0))
    for _ in range(100):
        budget.record_request()
    assert drain(budget) == 20
    snap = budget.snapshot()
    assert (snap.requests, snap.retries, snap.allowance) == (100, 20, pytest.approx(20))


def test_spent_budget_refills_as_the_window_slides():
    clock = FakeClock(500.0)
    budget = RetryBudget(RetryBudgetConfig(ratio=0.2, min_retries_per_s=0, window_s=10), clock)
    for _ in range(50):
        budget.record_request()
    assert drain(budget) == 10
    clock.advance(5)
    for _ in range(50):
        budget.record_request()
    assert drain(budget) == 10  # 100 requests allow 20, 10 already taken
    clock.advance(6)  # the first 50 requests and 10 retries slid out
    assert drain(budget) == 0
    clock.advance(5)
    assert budget.snapshot().requests == 0
    assert not budget.try_acquire()


def test_refusal_takes_nothing():
    budget = RetryBudget(RetryBudgetConfig(ratio=0, min_retries_per_s=0.1, window_s=10), FakeClock(500.0))
    assert budget.try_acquire()
    assert not budget.try_acquire()
    assert budget.snapshot().retries == 1


def test_attempts_per_request_are_capped():
    budget = RetryBudget(RetryBudgetConfig(max_attempts=3, min_retries_per_s=100), FakeClock(500.0))
    attempts = budget.start()
    assert budget.snapshot().requests == 1
    assert attempts.try_again() and attempts.try_again()
    assert attempts.attempts == 3
    assert not attempts.try_again()
    assert attempts.refusal is Refusal.MAX_ATTEMPTS
    assert budget.snapshot().retries == 2


def test_attempts_refused_by_the_budget():
    budget = RetryBudget(RetryBudgetConfig(ratio=0, min_retries_per_s=0), FakeClock(500.0))
    attempts = budget.start()
    assert not attempts.try_again()
    assert attempts.refusal is Refusal.BUDGET
    assert attempts.attempts == 1


def test_exhausted_is_unavailable():
    assert issubclass(RetryBudgetExhausted, Unavailable)


@pytest.mark.parametrize(
    "fields", [{"ratio": -0.1}, {"window_s": 0}, {"bucket_s": 20}, {"max_attempts": 0}, {"min_retries_per_s": -1}]
)
def test_invalid_config(fields):
    with pytest.raises(ValidationError):
        RetryBudgetConfig(**fields)
