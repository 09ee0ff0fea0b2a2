"""API-key authentication: the key in call metadata names the tenant of the call, and with
it what the call may claim (its tiers: `services.common.entitlements`).

A key with `acts_for_tenants` (the backfill's) may name another tenant in
`x-ballast-on-behalf-of`: the call then runs as that tenant (its quota, its share of the
pool, its grant). Any other key naming another tenant than its own is refused
(PERMISSION_DENIED): no tenant can spend another's quota.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from services.common.config import AuthConfig
from services.common.entitlements import allowed_tiers
from services.common.errors import InvalidArgument, PermissionDenied, Unauthenticated
from services.common.tier import TIER_ORDER, Tier

API_KEY_HEADER = "x-api-key"
ON_BEHALF_HEADER = "x-ballast-on-behalf-of"
MAX_TENANT_CHARS = 128


def _key_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    for name, value in metadata or ():
        if isinstance(value, bytes):
            continue
        name = name.lower()
        if name == API_KEY_HEADER:
            key = value.strip()
        elif name == "authorization" and value.lower().startswith("bearer "):
            key = value[7:].strip()
        else:
            continue
        # An empty header (a client's unset variable) is no key: it must not hide the other one.
        if key:
            return key
    return ""


def _header(metadata: Iterable[tuple[str, str | bytes]] | None, header: str) -> str | None:
    for name, value in metadata or ():
        if name.lower() == header and isinstance(value, str):
            return value.strip()
    return None


@dataclass(frozen=True)
class Caller:
    """Who a call runs as, and what it may claim."""

    # Whose request it is: its quota, its share of the pool, its grant.
    tenant: str
    # The tiers it may claim, most urgent first.
    tiers: tuple[Tier, ...]
    # The tenant of the key itself: differs from `tenant` when acting on another's behalf.
    key_tenant: str

    @property
    def on_behalf(self) -> bool:
        return self.tenant != self.key_tenant


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self.config = config

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller:
        """The caller's tenant and tiers, or raises Unauthenticated (no or unknown key),
        PermissionDenied (another tenant named by a key that may not act for tenants) or
        InvalidArgument (a tenant name no tenant can have)."""
        if not self.config.enabled:
            # Nobody is told apart: there is no other tenant to take anything from.
            return Caller(self.config.default_tenant, TIER_ORDER, self.config.default_tenant)
        metadata = list(metadata or ())
        key_tenant = self.tenant_for(metadata)
        entry = self.config.key(_key_from_metadata(metadata))
        assert entry is not None  # tenant_for refused unknown keys
        tenant = key_tenant
        named = _header(metadata, ON_BEHALF_HEADER)
        # Naming the key's own tenant is no privilege: allowed to any key.
        if named and named != key_tenant:
            if not entry.acts_for_tenants:
                raise PermissionDenied(
                    f"{ON_BEHALF_HEADER} may name another tenant only with a key that has "
                    f"acts_for_tenants; this key's calls run as its own tenant"
                )
            if len(named) > MAX_TENANT_CHARS or any(ord(ch) < 32 for ch in named):
                raise InvalidArgument(f"{ON_BEHALF_HEADER} must be at most {MAX_TENANT_CHARS} printable characters")
            tenant = named
        return Caller(tenant, allowed_tiers(self.config.grant(tenant).tiers, entry.max_tier), key_tenant)

    def tenant_for(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """Returns the caller's tenant, or raises Unauthenticated."""
        if not self.config.enabled:
            return self.config.default_tenant
        key = _key_from_metadata(metadata)
        if not key:
            raise Unauthenticated(f"missing API key: send call metadata '{API_KEY_HEADER}'")
        entry = self.config.key(key)
        if entry is None:
            raise Unauthenticated("unknown API key")
        return entry.tenant
