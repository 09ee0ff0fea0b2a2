"""Which version serves a request during a rollout: a weighted split, sticky per session.

A hash of tenant and session (the request id when there is no session) puts each
conversation in one of 10 000 buckets; the candidate takes the buckets below its weight. The
hash is salted with the model and the candidate version, so every router agrees on every
session without talking to the others, and each rollout draws a fresh slice of sessions.
Raising the weight only adds buckets: sessions already on the candidate stay there.

Mirroring draws separately (by request id): a mirrored request is served by the stable
version as usual, and a copy goes to the candidate.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from services.router.rollout.state import Phase, Rollout

BUCKETS = 10_000


class Role(str, enum.Enum):
    STABLE = "stable"
    CANDIDATE = "candidate"


@dataclass(frozen=True)
class Route:
    """The version a request runs on, and the one it may fall back to before any token."""

    version: str
    role: Role
    fallback: str | None = None
    mirror: bool = False

    def versions(self) -> tuple[str, ...]:
        return (self.version,) if self.fallback is None else (self.version, self.fallback)


def bucket(*parts: str) -> int:
    """A stable bucket in [0, BUCKETS) for the parts (sha256: the same in every process)."""
    digest = hashlib.sha256("\0".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def takes_share(percent: float, *parts: str) -> bool:
    return bucket(*parts) < round(percent * BUCKETS / 100)


def choose(rollout: Rollout, tenant: str, session_id: str, request_id: str) -> Route:
    """The route of one request under `rollout` (pure)."""
    stable = Route(rollout.stable, Role.STABLE)
    candidate = Route(rollout.candidate, Role.CANDIDATE, fallback=rollout.stable)
    if rollout.state is Phase.ROLLED_BACK:
        return stable  # the candidate failed its gate: never a fallback either
    if rollout.state is Phase.PROMOTED:
        return candidate
    sticky = f"session:{tenant}:{session_id}" if session_id else f"request:{tenant}:{request_id}"
    if takes_share(rollout.weight, "split", rollout.model, rollout.candidate, sticky):
        return candidate
    mirror = takes_share(rollout.mirror_percent, "mirror", rollout.model, rollout.candidate, request_id)
    return Route(rollout.stable, Role.STABLE, fallback=rollout.candidate, mirror=mirror)
