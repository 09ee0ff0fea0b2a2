"""Restart backoff: how long to wait before starting a process that died again.

One rule for the worker keeper and the local supervisor: the first restart waits `initial_s`,
each further death in a row doubles the wait up to `max_s`, and a process that stayed up for
`reset_after_s` after it was ready counts as healthy, so its next death starts again from
`initial_s`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackoffPolicy:
    """Exponential restart backoff with a cap and a reset after a healthy period."""

    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0
    reset_after_s: float = 10.0

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.max_s < self.initial_s or self.factor < 1 or self.reset_after_s <= 0:
            raise ValueError(
                f"invalid backoff policy {self}: need 0 <= initial_s <= max_s, factor >= 1, reset_after_s > 0"
            )


class RestartBackoff:
    """The waits of one process's restarts (pure: the caller says how long the process was up)."""

    def __init__(self, policy: BackoffPolicy) -> None:
        self.policy = policy
        # Deaths in a row without a healthy period between them.
        self.streak = 0

    def next_delay(self, uptime_s: float) -> float:
        """Records a death after `uptime_s` of serving (0: it never got ready); returns the wait
        before the restart."""
        if uptime_s >= self.policy.reset_after_s:
            self.streak = 0
        delay = min(self.policy.max_s, self.policy.initial_s * self.policy.factor**self.streak)
        self.streak += 1
        return delay

    @property
    def at_cap(self) -> bool:
        """True once the waits reached max_s: the process keeps dying (a crash loop)."""
        p = self.policy
        return self.streak > 0 and p.initial_s * p.factor ** (self.streak - 1) >= p.max_s
