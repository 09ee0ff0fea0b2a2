"""The restart backoff shared by the worker keeper and the local supervisor."""

from __future__ import annotations

import pytest

from services.common.backoff import BackoffPolicy, RestartBackoff


def test_waits_double_up_to_the_cap():
    backoff = RestartBackoff(BackoffPolicy(initial_s=0.5, max_s=4.0, reset_after_s=60.0))
    assert [backoff.next_delay(uptime_s=1.0) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.at_cap


def test_a_healthy_period_resets_the_waits():
    backoff = RestartBackoff(BackoffPolicy(initial_s=0.5, max_s=30.0, reset_after_s=60.0))
    assert [backoff.next_delay(uptime_s=1.0) for _ in range(3)] == [0.5, 1.0, 2.0]
    assert backoff.next_delay(uptime_s=60.0) == 0.5
    assert backoff.next_delay(uptime_s=59.0) == 1.0
    assert not backoff.at_cap


@pytest.mark.parametrize(
    "changes", [{"initial_s": -1.0}, {"max_s": 0.1, "initial_s": 1.0}, {"factor": 0.5}, {"reset_after_s": 0.0}]
)
def test_a_policy_that_cannot_work_is_refused(changes):
    with pytest.raises(ValueError):
        BackoffPolicy(**changes)
