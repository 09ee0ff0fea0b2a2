"""The simulated engine's prefix cache: whole blocks of a tenant's contexts, least recently
used first out, as a real engine's prefix cache with per-tenant salt behaves. A hit shortens
prefill by the tokens it covers."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        self.capacity = capacity_blocks
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def _names(self, tenant: str, token_ids: Sequence[int]) -> list[bytes]:
        names, running = [], hashlib.blake2b(tenant.encode(), digest_size=16)
        for start in range(0, len(token_ids) - self.block_tokens + 1, self.block_tokens):
            running.update(
                b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids[start : start + self.block_tokens])
            )
            names.append(running.copy().digest())
        return names

    def cached_tokens(self, tenant: str, token_ids: Sequence[int]) -> int:
        """Tokens of the longest cached prefix, never the whole context (its last token is
        always computed, as on a real engine)."""
        hits = 0
        for name in self._names(tenant, token_ids[:-1] if token_ids else token_ids):
            if name not in self._blocks:
                break
            self._blocks.move_to_end(name)
            hits += 1
        return hits * self.block_tokens

    def remember(self, tenant: str, token_ids: Sequence[int]) -> None:
        for name in self._names(tenant, token_ids):
            self._blocks[name] = None
            self._blocks.move_to_end(name)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
