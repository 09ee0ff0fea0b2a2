"""Per-tenant quotas: requests and tokens per minute, refused with RESOURCE_EXHAUSTED
(`QuotaExceeded`, reason `quota_exceeded`) and a retry hint of when the quota refills.

Each limit is a token bucket holding one minute's worth (a tenant may burst up to its
per-minute limit, then runs at the limit's rate). A request needs one request credit when it
arrives. Tokens (prompt + completion, from the answer's usage) are charged when the answer
ends, since nobody knows the answer's length before: a tenant may go into debt by its last
answer, and its next request waits until the bucket is positive again. Buckets live in each
router's memory: with N routers a tenant gets up to N times its limit (documented; a shared
store would cost a round trip per request).

`router.quotas` in ballast.yaml: a default for every tenant and overrides by tenant; 0 means
no limit. Pure: the clock is a parameter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from pydantic import Field

from services.common.config import Section
from services.common.errors import QuotaExceeded


class TenantLimits(Section):
    requests_per_minute: int = Field(0, ge=0, description="Requests a tenant may start per minute; 0: no limit.")
    tokens_per_minute: int = Field(
        0, ge=0, description="Prompt + completion tokens a tenant may use per minute; 0: no limit.")


class QuotaConfig(Section):
    default: TenantLimits = Field(default_factory=TenantLimits, description="Limits of every tenant.")
    tenants: dict[str, TenantLimits] = Field(
        default_factory=dict, description="Limits of named tenants, in place of the default.")

    def limits(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default)


@dataclass
class _Bucket:
    capacity: float
    per_s: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_s)
        self.at = now

    def wait_s(self, need: float) -> float:
        """Seconds until the bucket holds more than `need` (0 when it already does)."""
        return 0.0 if self.level >= need else (need - self.level) / self.per_s


class TenantQuotas:
    def __init__(self, config: QuotaConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    def _bucket(self, buckets: dict[str, _Bucket], tenant: str, per_minute: int) -> _Bucket | None:
        if per_minute <= 0:
            return None
        now = self._clock()
        bucket = buckets.get(tenant)
        if bucket is None or bucket.capacity != per_minute:  # new tenant, or its limit changed
            bucket = buckets[tenant] = _Bucket(per_minute, per_minute / 60.0, float(per_minute), now)
        bucket.refill(now)
        return bucket

    def admit(self, tenant: str) -> None:
        """Takes one request credit, or raises QuotaExceeded with when to retry."""
        limits = self.config.limits(tenant)
        tokens = self._bucket(self._tokens, tenant, limits.tokens_per_minute)
        if tokens is not None and tokens.level <= 0:
            raise QuotaExceeded(f"tenant {tenant!r} used its {limits.tokens_per_minute} tokens per minute",
                                retry_after_s=tokens.wait_s(1.0))
        requests = self._bucket(self._requests, tenant, limits.requests_per_minute)
        if requests is not None:
            if requests.level < 1.0:
                raise QuotaExceeded(f"tenant {tenant!r} used its {limits.requests_per_minute} requests per minute",
                                    retry_after_s=requests.wait_s(1.0))
            requests.level -= 1.0

    def charge_tokens(self, tenant: str, tokens: int) -> None:
        """Charges the tokens an answer used (it may leave the bucket in debt)."""
        bucket = self._bucket(self._tokens, tenant, self.config.limits(tenant).tokens_per_minute)
        if bucket is not None and tokens > 0:
            bucket.level -= tokens
