"""The simulated engine's timing model.

Prefill takes `prefill_base_ms + prefill_ms_per_token x uncached prompt tokens`; a decode
step takes `decode_base_ms + decode_ms_per_seq x running sequences + decode_ms_per_kv_token x
tokens held in the KV cache`, so inter-token latency grows with load as on a real engine.
`max_num_seqs` sequences run at once (the rest wait, in priority order); the KV cache holds
`kv_blocks` blocks of `block_tokens`. `jitter` scales every wait by a factor drawn from
[1 - jitter, 1 + jitter] with the profile's seed. A profile is JSON with these fields (any
left out keep their defaults) and a `source` saying where its numbers come from.

`from_engines_result` fits a profile to a `bench/engines.py` result (bench/results/
engines.json): the decode step from tokens/s at 1, 4 and 16 streams (a line through the
step times, least squares), prefill from the time to first token of one stream.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SimProfile:
    source: str = "default: round numbers of a small model on one GPU, not a measurement"
    prefill_base_ms: float = 5.0
    prefill_ms_per_token: float = 0.02
    decode_base_ms: float = 8.0
    decode_ms_per_seq: float = 0.1
    decode_ms_per_kv_token: float = 0.00002
    max_num_seqs: int = 64
    # Prompt tokens one prefill step computes at most: a longer prompt's prefill takes several
    # steps (as a chunked prefill does), and the engine's step count moves between them.
    prefill_chunk_tokens: int = 256
    kv_blocks: int = 8192
    block_tokens: int = 16
    jitter: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        numbers = (
            self.prefill_base_ms,
            self.prefill_ms_per_token,
            self.decode_base_ms,
            self.decode_ms_per_seq,
            self.decode_ms_per_kv_token,
        )
        if any(v < 0 for v in numbers) or not 0 <= self.jitter < 1:
            raise ValueError("sim profile: times must be >= 0 and jitter in [0, 1)")
        if min(self.max_num_seqs, self.kv_blocks, self.block_tokens, self.prefill_chunk_tokens) < 1:
            raise ValueError("sim profile: max_num_seqs, kv_blocks, block_tokens and prefill_chunk_tokens must be >= 1")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_blocks * self.block_tokens

    def prefill_ms(self, uncached_tokens: int) -> float:
        return self.prefill_base_ms + self.prefill_ms_per_token * max(0, uncached_tokens)

    def prefill_steps_ms(self, uncached_tokens: int) -> list[float]:
        """The prefill's time (`prefill_ms`) as steps of `prefill_chunk_tokens` at most, the
        base time in the first: one step for a prompt that fits a chunk."""
        tokens = max(0, uncached_tokens)
        chunks = [self.prefill_chunk_tokens] * (tokens // self.prefill_chunk_tokens)
        if tokens % self.prefill_chunk_tokens or not chunks:
            chunks.append(tokens % self.prefill_chunk_tokens)
        steps = [self.prefill_ms_per_token * chunk for chunk in chunks]
        steps[0] += self.prefill_base_ms
        return steps

    def decode_step_ms(self, running: int, kv_tokens: int) -> float:
        return self.decode_base_ms + self.decode_ms_per_seq * max(1, running) + self.decode_ms_per_kv_token * kv_tokens

    def jittered(self, ms: float, rng: random.Random) -> float:
        return ms * (1 + rng.uniform(-self.jitter, self.jitter)) if self.jitter else ms

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SimProfile":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"sim profile: unknown fields {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path | None) -> "SimProfile":
        if not path:
            return cls()
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def from_engines_result(result: dict, engine: str = "vllm") -> SimProfile:
    """A profile fitted to one engine of a bench/engines.py result."""
    levels = {int(n): level for n, level in result["engines"][engine].items() if str(n).isdigit()}
    # At c streams, each stream gets a token every c / tokens_per_s seconds: the step time.
    points = [(c, c / level["tokens_per_s"] * 1000) for c, level in sorted(levels.items())]
    mean_c = sum(c for c, _ in points) / len(points)
    mean_ms = sum(ms for _, ms in points) / len(points)
    spread = sum((c - mean_c) ** 2 for c, _ in points)
    slope = sum((c - mean_c) * (ms - mean_ms) for c, ms in points) / spread if spread else 0.0
    slope = max(0.0, slope)
    base = max(0.0, mean_ms - slope * mean_c)
    one = levels[min(levels)]
    step_one = base + slope
    prefill = max(0.0, one["ttft_p50_ms"] - step_one)
    commit = (
        result.get("commit", {}).get("sha", "unknown")[:10] if isinstance(result.get("commit"), dict) else "unknown"
    )
    return SimProfile(
        source=f"fitted to bench/engines.py ({engine}, {result.get('preset', '?')} model, commit {commit})",
        prefill_base_ms=round(prefill, 3),
        prefill_ms_per_token=0.0,
        decode_base_ms=round(base, 4),
        decode_ms_per_seq=round(slope, 4),
        decode_ms_per_kv_token=0.0,
        max_num_seqs=max(levels),
        jitter=0.05,
    )
