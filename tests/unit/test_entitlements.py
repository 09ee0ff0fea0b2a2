"""Tier entitlements: a tenant claims only the tiers its grant lists (a key may lower them),
anything higher is capped to the highest it may have and never refused; a key acting for
tenants alone may name another tenant; keys from the environment replace the file's."""

from __future__ import annotations

import pytest

from services.common.auth import ON_BEHALF_HEADER, Authenticator
from services.common.config import AuthConfig, ConfigError
from services.common.entitlements import CAPPED_BY_GRANT, RAISED_TO_GRANT, allowed_tiers, cap_tier
from services.common.errors import InvalidArgument, PermissionDenied, Unauthenticated
from services.config import load_config


@pytest.mark.parametrize(
    "asked, allowed, expected",
    [
        ("S", ("S", "A", "B"), ("S", None)),
        ("S", ("A", "B"), ("A", CAPPED_BY_GRANT)),
        ("A", ("A", "B"), ("A", None)),
        ("S", ("B",), ("B", CAPPED_BY_GRANT)),
        ("A", ("B",), ("B", CAPPED_BY_GRANT)),
        ("B", ("A", "B"), ("B", None)),
        ("B", ("S",), ("S", RAISED_TO_GRANT)),
    ],
)
def test_a_tier_above_the_grant_is_capped_to_the_highest_allowed(asked, allowed, expected):
    assert cap_tier(asked, allowed) == expected


def test_a_key_ceiling_lowers_the_grant_but_never_locks_the_key_out():
    assert allowed_tiers(["B", "S", "A"]) == ("S", "A", "B")
    assert allowed_tiers(["S", "A", "B"], "A") == ("A", "B")
    assert allowed_tiers(["S"], "B") == ("S",)


def auth(**extra) -> Authenticator:
    return Authenticator(
        AuthConfig(
            api_keys={
                "k-acme": "acme",
                "k-gold": "gold",
                "k-gold-intern": {"tenant": "gold", "max_tier": "B"},
                "k-backfill": {"tenant": "ballast-backfill", "acts_for_tenants": True},
            },
            tenants={"gold": {"tiers": ["S", "A", "B"]}},
            **extra,
        )
    )


def test_tenants_without_a_grant_get_a_and_b_and_granted_ones_their_tiers():
    a = auth()
    assert a.caller([("x-api-key", "k-acme")]).tiers == ("A", "B")
    assert a.caller([("x-api-key", "k-gold")]).tiers == ("S", "A", "B")
    intern = a.caller([("x-api-key", "k-gold-intern")])
    assert (intern.tenant, intern.tiers) == ("gold", ("B",))


def test_only_a_key_that_acts_for_tenants_may_run_as_another_tenant():
    a = auth()
    replay = a.caller([("x-api-key", "k-backfill"), (ON_BEHALF_HEADER, "gold")])
    assert (replay.tenant, replay.key_tenant, replay.on_behalf) == ("gold", "ballast-backfill", True)
    assert replay.tiers == ("S", "A", "B")  # the tenant's own grant, not the backfill's
    own = a.caller([("x-api-key", "k-backfill")])
    assert (own.tenant, own.on_behalf) == ("ballast-backfill", False)
    with pytest.raises(PermissionDenied, match=ON_BEHALF_HEADER):
        a.caller([("x-api-key", "k-acme"), (ON_BEHALF_HEADER, "gold")])
    assert a.caller([("x-api-key", "k-acme"), (ON_BEHALF_HEADER, "acme")]).tenant == "acme"  # itself: no privilege
    with pytest.raises(InvalidArgument, match="printable"):
        a.caller([("x-api-key", "k-backfill"), (ON_BEHALF_HEADER, "x" * 200)])
    with pytest.raises(Unauthenticated):
        a.caller([(ON_BEHALF_HEADER, "gold")])


def test_with_auth_off_every_call_may_claim_every_tier():
    caller = Authenticator(AuthConfig(enabled=False, default_tenant="dev")).caller([])
    assert (caller.tenant, caller.tiers) == ("dev", ("S", "A", "B"))


def test_keys_from_the_environment_replace_the_files(tmp_path):
    path = tmp_path / "ballast.yaml"
    path.write_text("auth:\n  api_keys: {old-key: acme, kept-key: globex}\n  tenants: {acme: {tiers: [S, A, B]}}\n")
    config = load_config(path, environ={"BALLAST__AUTH__API_KEYS": '{"new-key": "acme"}'})
    assert config.auth.api_keys == {"new-key": "acme"}  # old-key and kept-key are revoked
    with pytest.raises(Unauthenticated):
        Authenticator(config.auth).tenant_for([("x-api-key", "old-key")])
    # A deeper variable still lands inside a map the file (or another variable) set.
    config = load_config(path, environ={"BALLAST__AUTH__TENANTS__GLOBEX": '{"tiers": ["S"]}'})
    assert set(config.auth.tenants) == {"acme", "globex"}
    assert config.auth.api_keys == {"old-key": "acme", "kept-key": "globex"}


def test_a_bad_grant_names_the_field():
    with pytest.raises(ConfigError, match=r"auth\.tenants\.acme\.tiers"):
        load_config(environ={"BALLAST__AUTH__TENANTS": '{"acme": {"tiers": ["X"]}}'})
