"""Domain types of a generation shared by router and worker: sampling and finish reasons."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens. temperature == 0 is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    # With a seed, the random state at generated position p derives from (seed, p) only,
    # so any replica continuing a stream samples exactly what the first one would have.
    seed: int | None = None
    stop: tuple[str, ...] = ()
