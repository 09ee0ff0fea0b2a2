"""A request's tier: S, A or B from the most urgent down, or AUTO (let the auto-tagging rules
decide). A `str` enum, so metric labels, logs and JSON keep the text ("S", "A", "B", "AUTO").

Text (config, etcd rules, HTTP) and protobuf (`services.common.tier_pb`) become a `Tier` at
the edge; the core takes and returns the enum.
"""

from __future__ import annotations

import enum
from typing import Any


class Tier(enum.StrEnum):
    S = "S"
    A = "A"
    B = "B"
    # Unset: the auto-tagging rules give the request its tier before it is scheduled.
    AUTO = "AUTO"


# The tiers a request runs at, from the most urgent down (AUTO is never scheduled).
TIER_ORDER: tuple[Tier, ...] = (Tier.S, Tier.A, Tier.B)


def parse_tier(raw: Any, field: str, *, auto: bool = False) -> Tier:
    """`raw` ("S", "A", "B", or "AUTO" when `auto`) as a Tier; ValueError naming `field` otherwise."""
    allowed = (*TIER_ORDER, Tier.AUTO) if auto else TIER_ORDER
    if isinstance(raw, str) and raw in allowed:
        return Tier(raw)
    raise ValueError(f"{field} must be one of {', '.join(allowed)} (got {raw!r})")
