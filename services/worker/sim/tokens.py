"""Token ids of the simulated engine, drawn from (seed, prompt ids, absolute position) only.

The same request gives the same tokens on every sim worker, and a stream resumed at any
token (prompt + the ids already sent) continues with exactly the tokens the uninterrupted
one would have given: the position, not a generator's state, decides. Greedy requests use
seed 0; a sampled request without a seed gets a fresh one. Ids are drawn from the ordinary
(non-special) ids of the model's real tokenizer, so the text decodes.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence


class TokenSource:
    def __init__(self, ordinary_ids: Sequence[int]) -> None:
        if not ordinary_ids:
            raise ValueError("the tokenizer has no ordinary ids to draw from")
        self._ids = list(ordinary_ids)

    @staticmethod
    def prompt_key(prompt_ids: Sequence[int]) -> bytes:
        return hashlib.blake2b(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids), digest_size=16).digest()

    @property
    def ordinary_ids(self) -> list[int]:
        return list(self._ids)

    def token(self, seed: int, prompt_key: bytes, position: int, attempt: int = 0) -> int:
        """The id at `position`; a guided draw that did not fit takes the next `attempt`."""
        return self._ids[draw(seed, prompt_key, position, attempt) % len(self._ids)]


def draw(seed: int, prompt_key: bytes, position: int, attempt: int = 0) -> int:
    """A 64-bit number from (seed, prompt, position, attempt) alone."""
    packed = struct.pack("<Qq", seed & (2**64 - 1), position)
    if attempt:
        packed += struct.pack("<q", attempt)
    return int.from_bytes(hashlib.blake2b(prompt_key + packed, digest_size=8).digest(), "little")
