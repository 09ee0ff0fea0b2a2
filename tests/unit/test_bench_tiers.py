"""The tiers benchmark's reading of the router's S-tier histograms."""

from __future__ import annotations

import math

from bench.tiers import ROUTER_QUEUE_WAIT, bucket_percentile, s_tier_buckets

SCRAPE = """\
# TYPE ballast_router_ttft_milliseconds histogram
ballast_router_ttft_milliseconds_bucket{le="10.0",tier="S"} 10
ballast_router_ttft_milliseconds_bucket{le="25.0",tier="S"} 90
ballast_router_ttft_milliseconds_bucket{le="50.0",tier="S"} 99
ballast_router_ttft_milliseconds_bucket{le="+Inf",tier="S"} 100
ballast_router_ttft_milliseconds_bucket{le="10.0",tier="B"} 500
ballast_router_ttft_milliseconds_bucket{le="+Inf",tier="B"} 900
ballast_router_queue_wait_milliseconds_bucket{le="10.0",tier="S"} 7
"""


def test_only_the_s_tier_buckets_of_the_histogram_asked_for_are_read():
    assert s_tier_buckets(SCRAPE) == {10.0: 10, 25.0: 90, 50.0: 99, math.inf: 100}
    assert s_tier_buckets(SCRAPE, ROUTER_QUEUE_WAIT) == {10.0: 7}


def test_the_percentile_is_the_bound_of_the_bucket_holding_it_between_two_scrapes():
    after = s_tier_buckets(SCRAPE)
    assert bucket_percentile({}, after, 50) == 25.0
    assert bucket_percentile({}, after, 99) == 50.0
    assert bucket_percentile({}, after, 100) == math.inf
    # Only what was counted since the first scrape: 80 requests, 70 of them under 25 ms.
    before = {10.0: 10, 25.0: 20, 50.0: 20, math.inf: 20}
    assert bucket_percentile(before, after, 87) == 25.0
    assert bucket_percentile(before, after, 88) == 50.0


def test_nothing_counted_has_no_percentile():
    after = s_tier_buckets(SCRAPE)
    assert math.isnan(bucket_percentile(after, after, 99))
    assert math.isnan(bucket_percentile({}, {}, 99))
