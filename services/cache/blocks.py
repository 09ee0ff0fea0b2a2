"""Chained block hashes: the names under which a sequence's KV blocks are stored.

A sequence of token ids is cut into blocks of `block_tokens`; only full blocks are named.
The hash of block i covers a seed (model version, tenant, block size) and every token of
blocks 0..i, so two sequences share a block's name exactly when they share the whole prefix
up to its end, under the same model version and tenant. Any client (worker, router for
prefix affinity) computes the same names from the same tokens.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

from services.cache.types import BLOCK_HASH_BYTES, KVScope

_DOMAIN = b"ballast.kv.v1"


def chain_seed(scope: KVScope, block_tokens: int) -> bytes:
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    # Length-prefixed fields, so no two (version, tenant) pairs can produce the same bytes.
    fields = (_DOMAIN, scope.model_version.encode(), scope.tenant.encode(), str(block_tokens).encode())
    digest = hashlib.sha256()
    for field in fields:
        digest.update(struct.pack("<I", len(field)))
        digest.update(field)
    return digest.digest()


def chain_hashes(
    scope: KVScope, block_tokens: int, token_ids: Sequence[int], max_blocks: int | None = None
) -> list[bytes]:
    """Names of the full blocks of `token_ids` (at most `max_blocks`), in order."""
    state = chain_seed(scope, block_tokens)
    count = len(token_ids) // block_tokens
    if max_blocks is not None:
        count = min(count, max_blocks)
    names = []
    pack = struct.Struct(f"<{block_tokens}i").pack
    for i in range(count):
        block = token_ids[i * block_tokens : (i + 1) * block_tokens]
        # The full 32-byte state carries forward; only the stored name is truncated.
        state = hashlib.sha256(state + pack(*block)).digest()
        names.append(state[:BLOCK_HASH_BYTES])
    return names
