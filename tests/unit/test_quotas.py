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


def limited(**default) -> tuple[TenantQuotas, FakeClock]:
    clock = FakeClock(1000.0)
    return TenantQuotas(QuotaConfig(default=TenantLimits(**default), prompt_chars_per_token=4.0), clock), clock


def test_tokens_are_reserved_at_admission_so_a_burst_cannot_outspend_the_limit():
    q, _clock = limited(tokens_per_minute=300)
    # Each asks 40 prompt characters (10 tokens) + 90 completion tokens: 100 reserved.
    held = [q.admit("acme", prompt_chars=40, max_tokens=90) for _ in range(3)]
    assert [r.tokens for r in held] == [100, 100, 100]
    with pytest.raises(QuotaExceeded) as refused:
        q.admit("acme", prompt_chars=40, max_tokens=90)
    assert "reserves 100" in refused.value.message
    assert refused.value.retry_after_s == pytest.approx(20.0)  # 100 tokens at 5 per second


def test_settling_refunds_what_a_stream_did_not_use():
    q, _clock = limited(tokens_per_minute=300)
    held = [q.admit("acme", prompt_chars=40, max_tokens=90) for _ in range(3)]
    q.settle(held[0], 30)  # it used 30 of its 100: 70 back
    q.settle(held[0], 30)  # settled once only
    with pytest.raises(QuotaExceeded):
        q.admit("acme", prompt_chars=40, max_tokens=90)  # 70 < 100
    q.admit("acme", prompt_chars=40, max_tokens=60)  # 70 will do


def test_a_stream_that_used_more_than_it_reserved_leaves_debt():
    q, clock = limited(tokens_per_minute=600)  # 10 per second
    r = q.admit("acme", prompt_chars=4, max_tokens=99)  # 100 reserved
    q.settle(r, 700)  # the prompt was far longer in tokens than its estimate
    with pytest.raises(QuotaExceeded) as refused:
        q.admit("acme")
    assert refused.value.retry_after_s == pytest.approx(10.1)
    clock.advance(10.2)
    q.admit("acme")


def test_a_request_larger_than_the_whole_minute_waits_for_a_full_bucket():
    q, clock = limited(tokens_per_minute=60)  # 1 per second
    big = q.admit("acme", max_tokens=200)  # a full bucket lets it in, into debt
    q.settle(big, 200)
    with pytest.raises(QuotaExceeded) as refused:
        q.admit("acme", max_tokens=200)
    assert refused.value.retry_after_s == pytest.approx(200.0)  # from -140 back to a full 60
    clock.advance(200.0)
    q.admit("acme", max_tokens=200)


def test_open_streams_are_bounded_per_tenant_and_freed_when_settled():
    q, _clock = limited(max_concurrent=2)
    a, b = q.admit("acme"), q.admit("acme")
    with pytest.raises(QuotaExceeded) as refused:
        q.admit("acme")
    assert refused.value.fault is Fault.QUOTA_EXCEEDED
    q.admit("globex")  # another tenant's streams are its own
    q.settle(a, 0)
    c = q.admit("acme")
    assert q.open_streams("acme") == 2
    q.settle(b, 0)
    q.settle(c, 0)
    assert q.open_streams("acme") == 0


def test_a_refusal_takes_nothing():
    q, _clock = limited(requests_per_minute=10, tokens_per_minute=100, max_concurrent=5)
    first = q.admit("acme", max_tokens=100)
    for _ in range(3):
        with pytest.raises(QuotaExceeded):
            q.admit("acme", max_tokens=100)  # refused on tokens: no request credit, no stream taken
    assert q.open_streams("acme") == 1
    q.settle(first, 0)
    for _ in range(4):
        q.settle(q.admit("acme", max_tokens=10), 0)  # 4 of the 9 request credits left
    held = [q.admit("acme", max_tokens=10) for _ in range(5)]  # the other 5, and 5 streams
    with pytest.raises(QuotaExceeded, match="streams open"):
        q.admit("acme")
    q.settle(held[0], 0)
    with pytest.raises(QuotaExceeded, match="requests per minute"):
        q.admit("acme")
