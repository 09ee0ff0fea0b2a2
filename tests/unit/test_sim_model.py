"""The simulated engine's pure parts: the timing model, the token source and the prefix
cache."""

from __future__ import annotations

import random

import pytest

from services.worker.sim.prefix import PrefixCache
from services.worker.sim.profile import SimProfile, from_engines_result
from services.worker.sim.tokens import TokenSource


def test_costs_grow_with_uncached_tokens_batch_and_kv_fill():
    p = SimProfile()
    assert p.prefill_ms(0) < p.prefill_ms(100) < p.prefill_ms(1000)
    assert p.decode_step_ms(1, 0) < p.decode_step_ms(8, 0) < p.decode_step_ms(8, 100_000)
    assert p.jittered(10.0, random.Random(1)) == p.jittered(10.0, random.Random(1))
    assert 9.5 <= p.jittered(10.0, random.Random(2)) <= 10.5
    with pytest.raises(ValueError):
        SimProfile(max_num_seqs=0)
    with pytest.raises(ValueError, match="unknown fields"):
        SimProfile.from_dict({"decode_ms": 3})


def test_tokens_depend_on_seed_prompt_and_position_only():
    source = TokenSource(range(10, 500))
    key = source.prompt_key([5, 6, 7])
    stream = [source.token(0, key, p) for p in range(3, 40)]
    assert stream == [source.token(0, key, p) for p in range(3, 40)]  # same request, same tokens
    assert stream[10:] == [source.token(0, key, p) for p in range(13, 40)]  # resumed at any point
    assert stream != [source.token(1, key, p) for p in range(3, 40)]
    assert stream != [source.token(0, source.prompt_key([5, 6, 8]), p) for p in range(3, 40)]
    assert all(10 <= t < 500 for t in stream)


def test_prefix_cache_hits_whole_blocks_of_the_same_tenant_only():
    cache = PrefixCache(capacity_blocks=4, block_tokens=4)
    context = list(range(100, 111))  # 11 tokens: 2 whole blocks
    assert cache.cached_tokens("a", context) == 0
    cache.remember("a", context)
    assert cache.cached_tokens("a", context + [1, 2]) == 8
    assert cache.cached_tokens("a", context[:8]) == 4  # never the block holding the last token
    assert cache.cached_tokens("b", context) == 0
    cache.remember("b", list(range(200, 216)))  # 4 more blocks push a's out
    assert cache.cached_tokens("a", context) == 0


def test_a_profile_fitted_to_an_engines_result():
    result = {
        "preset": "tiny",
        "commit": {"sha": "abcdef1234567"},
        "engines": {
            "vllm": {
                "start_s": 17.0,
                "rss_bytes": 1,
                "1": {"ttft_p50_ms": 30.0, "tokens_per_s": 100.0},
                "4": {"ttft_p50_ms": 40.0, "tokens_per_s": 200.0},
                "16": {"ttft_p50_ms": 90.0, "tokens_per_s": 400.0},
            }
        },
    }
    profile = from_engines_result(result)
    # Step times 10, 20 and 40 ms at 1, 4 and 16 streams: a line of slope 2 through them.
    assert profile.decode_ms_per_seq == pytest.approx(2.0, rel=0.05)
    assert profile.decode_step_ms(16, 0) == pytest.approx(40.0, rel=0.1)
    assert profile.prefill_base_ms == pytest.approx(30.0 - profile.decode_step_ms(1, 0), abs=0.01)
    assert "abcdef1234" in profile.source and profile.max_num_seqs == 16


def test_a_long_prefill_takes_a_step_per_chunk_and_the_same_time_in_all():
    p = SimProfile(prefill_chunk_tokens=100)
    assert p.prefill_steps_ms(0) == [p.prefill_ms(0)]
    assert p.prefill_steps_ms(60) == [p.prefill_ms(60)]
    steps = p.prefill_steps_ms(250)
    assert len(steps) == 3 and sum(steps) == pytest.approx(p.prefill_ms(250))
    assert steps[0] == pytest.approx(p.prefill_base_ms + 100 * p.prefill_ms_per_token)
    assert steps[2] == pytest.approx(50 * p.prefill_ms_per_token)
    assert len(p.prefill_steps_ms(200)) == 2
    with pytest.raises(ValueError):
        SimProfile(prefill_chunk_tokens=0)
