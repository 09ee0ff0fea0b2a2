"""Tiers at the protobuf edge: the domain's tier names ("AUTO", "S", "A", "B") and their
`ballast.v1.Tier` values, both ways."""

from __future__ import annotations

from ballast.v1 import common_pb2

TIER_TO_PB = {"AUTO": common_pb2.TIER_AUTO, "S": common_pb2.TIER_S, "A": common_pb2.TIER_A, "B": common_pb2.TIER_B}
TIER_NAMES = {value: name for name, value in TIER_TO_PB.items()}
