"""Restore-or-recompute choice from running cost estimates."""

import pytest

from services.worker.kv.cost import CostModel, OnlineFit


def test_online_fit_recovers_a_linear_cost():
    fit = OnlineFit(2, forgetting=0.99)
    for k in (100, 2000, 500, 8000, 300, 4000) * 5:
        fit.observe([1.0, k / 1000], 3.0 + 0.05 * k)
    assert fit.predict([1.0, 6.0]) == pytest.approx(303.0, rel=0.02)


def quadratic_prefill(model: CostModel, a_ms: float = 0.1, b_ms: float = 0.05e-3) -> None:
    """Feeds prefill chunks whose cost grows with the context already there."""
    for total in (300, 1200, 4000, 700, 2500) * 4:
        for start in range(0, total, model.prefill_chunk):
            n = min(model.prefill_chunk, total - start)
            model.observe_prefill(start, n, 1.0 + a_ms * n + b_ms * n * (start + n / 2))


def test_prefill_estimate_follows_attention_growth():
    model = CostModel(prefill_chunk=512)
    quadratic_prefill(model)
    exact = lambda k: sum(  # noqa: E731
        1.0 + 0.1 * n + 0.05e-3 * n * (s + n / 2) for s in range(0, k, 512) for n in [min(512, k - s)]
    )
    for k in (256, 2048, 8192):
        assert model.recompute_ms(k) == pytest.approx(exact(k), rel=0.05)


def test_restores_while_learning_then_by_cost():
    model = CostModel(prefill_chunk=512, min_restore_samples=2, explore_every=0)
    assert model.decide(1024).restore and model.decide(1024).reason == "learning"
    quadratic_prefill(model)
    # Restore: 5 ms fixed + 0.01 ms per token.
    for k in (512, 4096, 1024, 8192):
        model.observe_restore(k, 5.0 + 0.01 * k)
    long = model.decide(8192)
    assert long.restore and long.reason == "cheaper" and long.restore_ms < long.recompute_ms
    # A short prefix is cheaper to recompute than the restore's fixed cost.
    short = model.decide(32)
    assert not short.restore and short.reason == "dearer"


def test_slow_cache_loses_and_is_reexplored_now_and_then():
    model = CostModel(prefill_chunk=512, explore_every=4)
    quadratic_prefill(model)
    for k in (512, 1024, 2048):
        model.observe_restore(k, 0.5 * k)  # far slower than prefill
    choices = [model.decide(1024) for _ in range(8)]
    assert [c.restore for c in choices].count(True) == 0  # 3x dearer: never worth a try
    for k in (512, 1024, 2048):
        model.observe_restore(k, 0.15 * k)  # a little slower than prefill
    choices = [model.decide(1024) for _ in range(8)]
    assert [c.reason for c in choices].count("explore") == 2


def test_lookup_skipped_when_the_restore_would_not_repay_it():
    model = CostModel(prefill_chunk=512)
    assert model.worth_lookup(32)  # nothing measured yet
    quadratic_prefill(model)
    model.observe_lookup(2.0)
    assert not model.worth_lookup(8) and model.worth_lookup(4096)  # even a free restore: 8 tokens
    for k in (512, 4096, 1024, 8192):
        model.observe_restore(k, 5.0 + 0.01 * k)
    # 300 tokens: prefill ~32 ms, restore ~8 ms: worth it. 40 tokens: prefill ~5 ms < restore.
    assert model.worth_lookup(300) and not model.worth_lookup(40)
