"""Tier entitlements: which tiers a caller may claim, and the tier a request gets from that.

A tenant's grant (`auth.tenants`, else `auth.default_grant`) lists the tiers it may claim; a
key may lower that with its own ceiling (`max_tier`). A request that asks for more, or that an
auto-tagging rule lifts higher, is capped to the highest tier it may have, never refused: the
tier it got and why travel in its Started event. Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.tier import TIER_ORDER, Tier

# Tier reasons this module gives (beside a rule's name or "explicit").
CAPPED_BY_GRANT = "capped_by_grant"
RAISED_TO_GRANT = "raised_to_grant"


def allowed_tiers(granted: Sequence[Tier], max_tier: Tier | None = None) -> tuple[Tier, ...]:
    """The granted tiers no more urgent than the key's ceiling, most urgent first. A ceiling
    below every granted tier leaves the least urgent granted one: a key is never locked out."""
    ordered = tuple(t for t in TIER_ORDER if t in granted)
    if max_tier is None:
        return ordered
    ceiling = TIER_ORDER.index(max_tier)
    kept = tuple(t for t in ordered if TIER_ORDER.index(t) >= ceiling)
    return kept or ordered[-1:]


def cap_tier(tier: Tier, allowed: tuple[Tier, ...]) -> tuple[Tier, str | None]:
    """(tier the request runs at, why it differs from `tier` or None when it does not).

    Above what it may have: the most urgent allowed tier below the one asked for. A grant with
    nothing at or below it (say only S) gives its least urgent tier instead."""
    if tier in allowed or not allowed:
        return tier, None
    asked = TIER_ORDER.index(tier)
    below = [t for t in allowed if TIER_ORDER.index(t) > asked]
    if below:
        return below[0], CAPPED_BY_GRANT
    return allowed[-1], RAISED_TO_GRANT
