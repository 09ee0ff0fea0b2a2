"""Per-tenant quotas: requests and tokens per minute and streams at once, refused with
RESOURCE_EXHAUSTED (`QuotaExceeded`, reason `quota_exceeded`) and a retry hint of when the
quota refills.

Each rate is a token bucket holding one minute's worth (a tenant may burst up to its
per-minute limit, then runs at the limit's rate). A request takes one request credit and
reserves its tokens when it is admitted: the prompt's estimate (its characters over
`prompt_chars_per_token`; the exact count is known only once a worker tokenizes it) plus its
`max_tokens`. It is admitted only if the bucket holds that much (or, for one larger than the
whole minute, a full bucket), so a burst of concurrent requests cannot spend more than the
limit. When the stream ends, however it ends (finished, cancelled, failed, degraded), the
reservation is settled against what it used: the answer's usage when a Finished event came,
else the prompt's estimate plus the tokens relayed; the unused part goes back to the bucket.
A request that never reached a worker is charged nothing.

`max_concurrent` bounds a tenant's open streams; each reservation holds one until settled.
A backfill replay runs as the tenant whose request degraded (`x-ballast-on-behalf-of`, from a
key with `acts_for_tenants`), so it is charged here like any of that tenant's requests.

Buckets live in each router's memory: with N routers a tenant gets up to N times its limit
(documented; a shared store would cost a round trip per request). The processes of one router
(`router.processes`) share its limits instead: each holds 1/N of them.

`router.quotas` in ballast.yaml: a default for every tenant and overrides by tenant; 0 means
no limit. Pure: the clock is a parameter.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from pydantic import Field

from services.common.config import Section
from services.common.errors import QuotaExceeded

# The hint of a refusal for too many open streams: none refills by time, one ends soon enough.
CONCURRENCY_RETRY_S = 1.0


class TenantLimits(Section):
    requests_per_minute: int = Field(0, ge=0, description="Requests a tenant may start per minute; 0: no limit.")
    tokens_per_minute: int = Field(
        0, ge=0, description="Prompt + completion tokens a tenant may use per minute; 0: no limit."
    )
    max_concurrent: int = Field(0, ge=0, description="Streams a tenant may have open at once; 0: no limit.")

    def shared_by(self, processes: int) -> "TenantLimits":
        """One of `processes` equal shares of these limits (rounded up: a limit never becomes
        0, which would mean none)."""

        def share(limit: int) -> int:
            return math.ceil(limit / processes) if limit else 0

        return TenantLimits(
            requests_per_minute=share(self.requests_per_minute),
            tokens_per_minute=share(self.tokens_per_minute),
            max_concurrent=share(self.max_concurrent),
        )


class QuotaConfig(Section):
    default: TenantLimits = Field(default_factory=TenantLimits, description="Limits of every tenant.")
    tenants: dict[str, TenantLimits] = Field(
        default_factory=dict, description="Limits of named tenants, in place of the default."
    )
    prompt_chars_per_token: float = Field(
        4.0,
        gt=0,
        le=16,
        description="Characters per prompt token assumed when reserving a request's tokens "
        "before its prompt is tokenized (settled to the real count at the end); "
        "lower reserves more.",
    )

    def limits(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default)

    def shared_by(self, processes: int) -> "QuotaConfig":
        """What one of `processes` router processes on one port admits: a share of every limit,
        so that together they admit what one process would (router.processes)."""
        return self.model_copy(
            update={
                "default": self.default.shared_by(processes),
                "tenants": {tenant: limits.shared_by(processes) for tenant, limits in self.tenants.items()},
            }
        )


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
        """Seconds until the bucket holds `need` (0 when it already does)."""
        return 0.0 if self.level >= need else (need - self.level) / self.per_s


@dataclass
class Reservation:
    """What an admitted request holds until it is settled: one open stream and its tokens."""

    tenant: str
    tokens: int
    prompt_estimate: int
    settled: bool = False


class TenantQuotas:
    def __init__(self, config: QuotaConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        self._open: dict[str, int] = {}

    def _bucket(self, buckets: dict[str, _Bucket], tenant: str, per_minute: int) -> _Bucket | None:
        if per_minute <= 0:
            return None
        now = self._clock()
        bucket = buckets.get(tenant)
        if bucket is None or bucket.capacity != per_minute:  # new tenant, or its limit changed
            bucket = buckets[tenant] = _Bucket(per_minute, per_minute / 60.0, float(per_minute), now)
        bucket.refill(now)
        return bucket

    def prompt_estimate(self, prompt_chars: int) -> int:
        """Prompt tokens assumed before the prompt is tokenized."""
        return math.ceil(prompt_chars / self.config.prompt_chars_per_token)

    def open_streams(self, tenant: str) -> int:
        return self._open.get(tenant, 0)

    def admit(self, tenant: str, prompt_chars: int = 0, max_tokens: int = 0) -> Reservation:
        """Takes a request credit, an open stream and the request's token reservation, or raises
        QuotaExceeded with when to retry (and takes nothing)."""
        limits = self.config.limits(tenant)
        prompt = self.prompt_estimate(prompt_chars)
        reserve = prompt + max_tokens
        if limits.max_concurrent and self.open_streams(tenant) >= limits.max_concurrent:
            raise QuotaExceeded(
                f"tenant {tenant!r} has its {limits.max_concurrent} streams open at once",
                retry_after_s=CONCURRENCY_RETRY_S,
            )
        tokens = self._bucket(self._tokens, tenant, limits.tokens_per_minute)
        # A request larger than the whole minute waits for a full bucket, then goes into debt.
        need = min(float(reserve), tokens.capacity) if tokens is not None else 0.0
        if tokens is not None and (tokens.level < need or tokens.level <= 0):
            raise QuotaExceeded(
                f"tenant {tenant!r} used its {limits.tokens_per_minute} tokens per minute (this request "
                f"reserves {reserve}: prompt {prompt} + max_tokens {max_tokens})",
                retry_after_s=tokens.wait_s(max(need, 1.0)),
            )
        requests = self._bucket(self._requests, tenant, limits.requests_per_minute)
        if requests is not None and requests.level < 1.0:
            raise QuotaExceeded(
                f"tenant {tenant!r} used its {limits.requests_per_minute} requests per minute",
                retry_after_s=requests.wait_s(1.0),
            )
        if requests is not None:
            requests.level -= 1.0
        if tokens is not None:
            tokens.level -= reserve
        self._open[tenant] = self.open_streams(tenant) + 1
        return Reservation(tenant, reserve, prompt)

    def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Ends a reservation: the stream is closed and the tokens it used replace what it
        reserved (the rest goes back; more than reserved leaves the bucket in debt). A second
        settle of the same reservation does nothing."""
        if reservation.settled:
            return
        reservation.settled = True
        tenant = reservation.tenant
        left = self.open_streams(tenant) - 1
        if left > 0:
            self._open[tenant] = left
        else:
            self._open.pop(tenant, None)
        bucket = self._bucket(self._tokens, tenant, self.config.limits(tenant).tokens_per_minute)
        if bucket is not None:
            bucket.level = min(bucket.capacity, bucket.level + reservation.tokens - max(0, used_tokens))

    def charge_tokens(self, tenant: str, tokens: int) -> None:
        """Charges tokens used outside any reservation (it may leave the bucket in debt)."""
        bucket = self._bucket(self._tokens, tenant, self.config.limits(tenant).tokens_per_minute)
        if bucket is not None and tokens > 0:
            bucket.level -= tokens
