"""Chained block hashes: a block's name binds the model version, the tenant, the block size
and the whole prefix up to its end."""

import pytest

from services.cache.blocks import chain_hashes
from services.cache.types import BLOCK_HASH_BYTES, KVScope

SCOPE = KVScope("v1", "acme")
TOKENS = list(range(100, 164))  # four blocks of 16


def test_only_full_blocks_are_named():
    assert len(chain_hashes(SCOPE, 16, TOKENS)) == 4
    assert len(chain_hashes(SCOPE, 16, TOKENS[:63])) == 3
    assert chain_hashes(SCOPE, 16, TOKENS[:15]) == []
    assert len(chain_hashes(SCOPE, 16, TOKENS, max_blocks=2)) == 2
    assert all(len(h) == BLOCK_HASH_BYTES for h in chain_hashes(SCOPE, 16, TOKENS))


def test_deterministic_and_prefix_stable():
    full = chain_hashes(SCOPE, 16, TOKENS)
    assert full == chain_hashes(SCOPE, 16, tuple(TOKENS))
    # A longer sequence with the same start names the same leading blocks.
    assert chain_hashes(SCOPE, 16, TOKENS + [7] * 40)[:4] == full
    assert len(set(full)) == 4


def test_each_block_covers_everything_before_it():
    changed = list(TOKENS)
    changed[3] += 1  # a token of block 0
    a, b = chain_hashes(SCOPE, 16, TOKENS), chain_hashes(SCOPE, 16, changed)
    assert all(x != y for x, y in zip(a, b))
    changed = list(TOKENS)
    changed[40] += 1  # a token of block 2
    b = chain_hashes(SCOPE, 16, changed)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]


@pytest.mark.parametrize("other", [KVScope("v2", "acme"), KVScope("v1", "globex"), KVScope("v1", "")])
def test_bound_to_model_version_and_tenant(other):
    mine, theirs = chain_hashes(SCOPE, 16, TOKENS), chain_hashes(other, 16, TOKENS)
    assert not set(mine) & set(theirs)


def test_bound_to_block_size():
    assert not set(chain_hashes(SCOPE, 16, TOKENS)) & set(chain_hashes(SCOPE, 32, TOKENS))


def test_fields_cannot_run_into_each_other():
    # ("v1", "xacme") and ("v1x", "acme") would collide if fields were simply concatenated.
    assert chain_hashes(KVScope("v1", "xacme"), 16, TOKENS) != chain_hashes(KVScope("v1x", "acme"), 16, TOKENS)
