"""Token selection from next-token logits: greedy, temperature and nucleus (top-p) sampling.

With a seed, the random draw for generated position p comes from a generator seeded with a
stable hash of (seed, p) alone, never from a generator that advances with every draw. A
replica that resumes a stream at position k therefore samples exactly what the first
replica would have, without replaying the first k draws. Sampling always runs on the CPU
so CPU and GPU engines draw from the same random stream.
"""

from __future__ import annotations

import hashlib
import secrets

import torch


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed derived from (seed, position) only; stable across processes and
    Python versions (unlike `hash()`)."""
    digest = hashlib.sha256(f"ballast-sampling:{seed}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


# Temperatures below this are greedy: a logit divided by them overflows float32.
MIN_TEMPERATURE = 1e-5


def position_generator(seed: int, position: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(position_seed(seed, position))


def fresh_seed() -> int:
    """A seed for a request that gave none: fresh randomness per request."""
    return secrets.randbits(63)


def select_token(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, generator: torch.Generator | None = None
) -> int:
    """Pick the next token from a 1-D logits vector.

    temperature == 0 is greedy (argmax, lowest id on ties), and so is any temperature below
    MIN_TEMPERATURE (as in vLLM: dividing by it would overflow float32). Otherwise logits are divided by
    the temperature, restricted to the smallest set of most likely tokens whose probability
    reaches `top_p`, and one token is drawn with `generator`.
    """
    logits = logits.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    if temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    # Shifted so the largest logit is 0: a small temperature then sends the others towards
    # -inf (probability 0), never to +inf (which would make every probability NaN).
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    # Stable sort so equal probabilities keep id order and the kept set is deterministic.
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    # Keep a token when the mass before it is still short of top_p; the top token always stays.
    keep_sorted = (cumulative - sorted_probs) < top_p
    keep_sorted[0] = True
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
    return torch.where(keep, probs, torch.zeros_like(probs))
