"""API-key authentication: the key in call metadata names the tenant of the call."""

from __future__ import annotations

from typing import Iterable

from services.common.config import AuthConfig
from services.common.errors import Unauthenticated

API_KEY_HEADER = "x-api-key"


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


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self.config = config

    def tenant_for(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """Returns the caller's tenant, or raises Unauthenticated."""
        if not self.config.enabled:
            return self.config.default_tenant
        key = _key_from_metadata(metadata)
        if not key:
            raise Unauthenticated(f"missing API key: send call metadata '{API_KEY_HEADER}'")
        tenant = self.config.api_keys.get(key)
        if tenant is None:
            raise Unauthenticated("unknown API key")
        return tenant
