"""Per-tenant quotas: refusals with a retry hint when a tenant's requests or tokens per
minute run out, refills at the limit's rate, tenants apart, overrides by tenant."""

from __future__ import annotations

import pytest

from services.common.errors import Fault, QuotaExceeded
from services.router.quotas import QuotaConfig, TenantLimits, TenantQuotas
from tests.unit.fake_clock import FakeClock


def quotas(**default) -> tuple[TenantQuotas, FakeClock]:
    clock = FakeClock(1000.0)
    config = QuotaConfig(default=TenantLimits(**default), tenants={"vip": TenantLimits(requests_per_minute=100)})
    return TenantQuotas(config, clock), clock


def test_requests_per_minute_burst_then_refuse_with_when_to_retry():
    q, clock = quotas(requests_per_minute=3)
    for _ in range(3):
        q.admit("acme")
    with pytest.raises(QuotaExceeded) as refused:
        q.admit("acme")
    assert refused.value.fault is Fault.QUOTA_EXCEEDED
    assert refused.value.retry_after_s == pytest.approx(20.0)  # one request refills in 60/3 s
    clock.advance(20.0)
    q.admit("acme")
    with pytest.raises(QuotaExceeded):
        q.admit("acme")


def test_tenants_are_counted_apart_and_overrides_apply():
    q, _clock = quotas(requests_per_minute=1)
    q.admit("acme")
    q.admit("globex")  # another tenant's bucket
    with pytest.raises(QuotaExceeded):
        q.admit("acme")
    for _ in range(100):
        q.admit("vip")


def test_tokens_are_charged_after_the_answer_and_debt_blocks_until_repaid():
    q, clock = quotas(tokens_per_minute=600)  # 10 tokens per second
    q.admit("acme")
    q.charge_tokens("acme", 700)  # one answer longer than the whole minute's worth
    with pytest.raises(QuotaExceeded) as refused:
        q.admit("acme")
    assert refused.value.retry_after_s == pytest.approx(10.1)  # back above zero: 101 tokens at 10/s
    clock.advance(10.2)
    q.admit("acme")


def test_no_limit_means_no_refusal():
    q, _clock = quotas()
    for _ in range(1000):
        q.admit("acme")
        q.charge_tokens("acme", 10_000)
