"""Token selection: greedy, temperature, top-p, and position-seeded randomness."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from services.worker.sampling import (
    fresh_seed,
    position_generator,
    position_seed,
    select_token,
)


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def test_greedy_is_argmax_with_lowest_id_on_ties():
    assert select_token(torch.tensor([0.1, 3.0, -2.0, 2.9]), temperature=0.0) == 1
    assert select_token(torch.tensor([1.0, 5.0, 5.0, 0.0]), temperature=0.0) == 1
    # Greedy ignores top_p and needs no generator.
    assert select_token(torch.tensor([0.0, 0.0, 9.0]), temperature=0.0, top_p=0.1) == 2


def test_position_seed_is_stable_and_depends_on_both_inputs():
    # Fixed values: a replica in another process (or release) must derive the same seeds.
    assert position_seed(0, 0) == 7067210237176147221
    assert position_seed(42, 7) == 751866669155978266
    seeds = {position_seed(s, p) for s in range(5) for p in range(50)}
    assert len(seeds) == 250
    assert all(0 <= s < 2**63 for s in seeds)


def test_same_seed_and_position_give_the_same_token():
    logits = torch.randn(512, generator=torch.Generator().manual_seed(1))
    for position in range(20):
        a = select_token(logits, 1.0, 0.9, position_generator(7, position))
        b = select_token(logits, 1.0, 0.9, position_generator(7, position))
        assert a == b
    # Drawing at position 5 does not depend on whether 0..4 were drawn first.
    fresh = select_token(logits, 1.0, 1.0, position_generator(7, 5))
    assert fresh == select_token(logits, 1.0, 1.0, position_generator(7, 5))


def test_samples_follow_the_distribution():
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = Counter(select_token(_logits(probs), 1.0, 1.0, position_generator(3, p)) for p in range(4000))
    for token, p in enumerate(probs):
        assert abs(counts[token] / 4000 - p) < 0.03, counts


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = [0.05, 0.5, 0.15, 0.3]  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    draws = lambda top_p: {  # noqa: E731
        select_token(_logits(probs), 1.0, top_p, position_generator(11, p)) for p in range(400)
    }
    assert draws(0.5) == {1}
    assert draws(0.6) == {1, 3}
    assert draws(0.9) == {1, 3, 2}
    assert draws(1.0) == {0, 1, 2, 3}
    assert draws(1e-6) == {1}  # the most likely token always stays


def test_low_temperature_approaches_greedy():
    logits = torch.tensor([1.0, 1.5, 0.5])
    assert {select_token(logits, 0.01, 1.0, position_generator(5, p)) for p in range(200)} == {1}
    # High temperature flattens: every token shows up.
    assert {select_token(logits, 5.0, 1.0, position_generator(5, p)) for p in range(200)} == {0, 1, 2}


def test_unseeded_requests_get_fresh_seeds():
    assert len({fresh_seed() for _ in range(20)}) == 20


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-7, 1e-5, 1e-3])
def test_tiny_temperatures_pick_the_most_likely_token_and_never_fail(temperature):
    logits = torch.tensor([1.0, 7.5, 7.25, -3.0, float("-inf")])
    for seed in range(20):
        assert select_token(logits, temperature, 0.9, torch.Generator().manual_seed(seed)) == 1
