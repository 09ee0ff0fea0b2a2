"""The Tier enum: text and protobuf become one at the edges, with an error naming the field
for anything else; the enum keeps its text in labels, logs and JSON."""

from __future__ import annotations

import json

import pytest

from ballast.v1 import common_pb2
from services.common.config import AuthConfig, ConfigError
from services.common.entitlements import allowed_tiers, cap_tier
from services.common.tier import TIER_ORDER, Tier, parse_tier
from services.common.tier_pb import TIER_TO_PB, tier_from_pb, tier_to_pb
from services.config import load_config
from services.router.resilience.stall import StallConfig
from services.router.scheduling.tagging import RuleError, load_rules
from services.router.scheduling.tiers import TierPolicy


def test_a_tier_keeps_its_text():
    assert [str(t) for t in Tier] == ["S", "A", "B", "AUTO"]
    assert f"tier {Tier.S}" == "tier S" and Tier.B == "B"
    assert json.dumps({Tier.A: [Tier.B]}) == '{"A": ["B"]}'
    assert TIER_ORDER == (Tier.S, Tier.A, Tier.B)


def test_text_is_parsed_at_the_edge_naming_the_field():
    assert parse_tier("S", "x") is Tier.S
    assert parse_tier("AUTO", "x", auto=True) is Tier.AUTO
    for raw in ("AUTO", "s", "", None, 1):
        with pytest.raises(ValueError, match="default.tier must be one of S, A, B"):
            parse_tier(raw, "default.tier")


def test_one_table_maps_every_tier_to_protobuf_and_back():
    pairs = {
        Tier.AUTO: common_pb2.TIER_AUTO,
        Tier.S: common_pb2.TIER_S,
        Tier.A: common_pb2.TIER_A,
        Tier.B: common_pb2.TIER_B,
    }
    for tier, value in pairs.items():
        assert tier_to_pb(tier) == value and TIER_TO_PB[tier.value] == value
        assert tier_from_pb(value) is tier


def test_config_tiers_become_the_enum_and_an_unknown_one_names_its_field(tmp_path):
    auth = AuthConfig(api_keys={"k": {"tenant": "g", "max_tier": "A"}}, tenants={"g": {"tiers": ["B", "S"]}})
    assert auth.grant("g").tiers == [Tier.B, Tier.S] and all(isinstance(t, Tier) for t in auth.grant("g").tiers)
    assert auth.key("k").max_tier is Tier.A
    assert AuthConfig().default_grant.tiers == [Tier.A, Tier.B]
    path = tmp_path / "ballast.yaml"
    path.write_text("auth:\n  tenants: {acme: {tiers: [S, X]}}\n")
    with pytest.raises(ConfigError, match=r"auth\.tenants\.acme\.tiers\.1.*must be one of S, A, B \(got 'X'\)"):
        load_config(path, environ={})
    path.write_text("auth:\n  api_keys: {k: {tenant: acme, max_tier: AUTO}}\n")
    with pytest.raises(ConfigError, match=r"auth\.api_keys\.k\.ApiKey\.max_tier.*got 'AUTO'"):
        load_config(path, environ={})


def test_the_core_answers_in_the_enum():
    assert allowed_tiers([Tier.B, Tier.S], Tier.A) == (Tier.B,)
    assert cap_tier(Tier.S, (Tier.A, Tier.B)) == (Tier.A, "capped_by_grant")
    assert StallConfig().timeout_for(Tier.S) == 2.0
    with pytest.raises(ValueError, match="unknown tier 'AUTO'"):
        StallConfig().timeout_for(Tier.AUTO)
    policy = TierPolicy.from_mapping({"tiers": {"B": {"max_queue": 3}}})
    assert set(policy.tiers) == set(TIER_ORDER) and policy.spec(Tier.B).max_queue == 3
    rules = load_rules("rules: [{name: r, when: {platform: web}, tier: S}]\ndefault: {tier: B}\n")
    assert rules.default_tier is Tier.B and rules.rules[0].tier is Tier.S
    with pytest.raises(RuleError, match="default.tier.*must be one of S, A, B"):
        load_rules("rules: []\ndefault: {tier: AUTO}\n")
