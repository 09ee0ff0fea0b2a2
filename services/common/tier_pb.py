"""Tiers at the protobuf edge: each `Tier` and its `ballast.v1.Tier` value, both ways (the one
table)."""

from __future__ import annotations

from collections.abc import Mapping

from ballast.v1 import common_pb2
from services.common.tier import Tier

# Keyed by Tier; a Tier is a str, so callers holding the text ("S") look it up as well.
TIER_TO_PB: Mapping[str, common_pb2.Tier.ValueType] = {
    Tier.AUTO: common_pb2.TIER_AUTO,
    Tier.S: common_pb2.TIER_S,
    Tier.A: common_pb2.TIER_A,
    Tier.B: common_pb2.TIER_B,
}
TIER_NAMES: Mapping[int, Tier] = {value: Tier(name) for name, value in TIER_TO_PB.items()}


def tier_to_pb(tier: Tier) -> common_pb2.Tier.ValueType:
    return TIER_TO_PB[tier]


def tier_from_pb(value: int) -> Tier:
    """The Tier of a `ballast.v1.Tier` value; KeyError for a value it does not know."""
    return TIER_NAMES[value]
