"""Poison-request quarantine, as the router and the backfill both read it.

A request that killed or stalled the workers it ran on is known by its fingerprint: a sha256
over its tenant, its input (prompt or messages) and its JSON Schema text, never its request_id,
so a client retrying it under a new id is known too. The router writes each quarantined
fingerprint to etcd under `<prefix>quarantine/<fingerprint>` with a lease of the quarantine's
time to live; every router replica and the backfill follow that prefix into a
`QuarantineStore`, the bounded in-memory copy they decide on (and keep using while etcd is
away). The record holds no prompt text: a fingerprint is safe to log and to list.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

from ballast.v1 import backfill_pb2

QUARANTINE_PREFIX = "quarantine/"
Clock = Callable[[], float]


def fingerprint(tenant: str, prompt: str | None, messages: Sequence[tuple[str, str]], schema: str) -> str:
    """The request's quarantine fingerprint (64 hex digits): tenant, prompt or messages, schema."""
    # JSON keeps the parts apart: no way to shift text from one field into the next.
    data = [tenant, prompt, None if prompt is not None else [[role, content] for role, content in messages], schema]
    return hashlib.sha256(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def request_fingerprint(request: Any) -> str:
    """The fingerprint of a router's validated request (tenant, prompt, messages, response_format)."""
    return fingerprint(
        request.tenant, request.prompt, [(m.role, m.content) for m in request.messages], request.response_format
    )


def degraded_fingerprint(record: backfill_pb2.DegradedRequest) -> str:
    """The fingerprint of a degraded request as the router saw it (its tenant, not the backfill's)."""
    request = record.request
    prompt = request.prompt if request.WhichOneof("input") == "prompt" else None
    messages = [(m.role, m.content) for m in request.conversation.messages]
    return fingerprint(record.tenant, prompt, messages, request.response_format)


def quarantine_key(prefix: str, fp: str) -> str:
    return f"{prefix}{QUARANTINE_PREFIX}{fp}"


class InvalidQuarantineEntry(ValueError):
    """A value under the quarantine prefix that is not an entry."""


@dataclass(frozen=True)
class QuarantineEntry:
    """One quarantined fingerprint: whose, why, since when (epoch seconds), for how long."""

    fingerprint: str
    tenant: str
    reason: str
    since: float
    workers_lost: int
    ttl_s: float

    def expires_at(self) -> float:
        return self.since + self.ttl_s

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "QuarantineEntry":
        try:
            data = json.loads(raw)
            entry = cls(
                fingerprint=str(data["fingerprint"]),
                tenant=str(data["tenant"]),
                reason=str(data["reason"]),
                since=float(data["since"]),
                workers_lost=int(data["workers_lost"]),
                ttl_s=float(data["ttl_s"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidQuarantineEntry(f"not a quarantine entry: {exc}") from None
        if len(entry.fingerprint) != 64 or entry.ttl_s <= 0:
            raise InvalidQuarantineEntry("not a quarantine entry: bad fingerprint or ttl")
        return entry


class QuarantineStore:
    """Quarantined fingerprints held in memory until they lapse, at most `max_entries` (past
    that the entry that lapses first goes). `clock` gives epoch seconds (injectable in tests)."""

    def __init__(self, max_entries: int = 10_000, clock: Clock = time.time) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[str, QuarantineEntry] = {}

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def is_empty(self) -> bool:
        """True when nothing is held (lapsed entries included: checked per request, so O(1))."""
        return not self._entries

    def _expire(self) -> None:
        now = self._clock()
        for fp in [fp for fp, entry in self._entries.items() if entry.expires_at() <= now]:
            del self._entries[fp]

    def add(self, entry: QuarantineEntry) -> None:
        """Holds `entry` (an existing one for the fingerprint is replaced) unless it has lapsed."""
        if entry.expires_at() <= self._clock():
            return
        self._entries[entry.fingerprint] = entry
        if len(self._entries) > self.max_entries:
            self._expire()
            while len(self._entries) > self.max_entries:
                del self._entries[min(self._entries.values(), key=QuarantineEntry.expires_at).fingerprint]

    def remove(self, fp: str) -> None:
        self._entries.pop(fp, None)

    def get(self, fp: str) -> QuarantineEntry | None:
        """The entry quarantining `fp` now, or None."""
        entry = self._entries.get(fp)
        if entry is None:
            return None
        if entry.expires_at() <= self._clock():
            del self._entries[fp]
            return None
        return entry

    def remaining_s(self, entry: QuarantineEntry) -> float:
        return max(0.0, entry.expires_at() - self._clock())

    def entries(self) -> list[QuarantineEntry]:
        self._expire()
        return sorted(self._entries.values(), key=lambda e: e.since)

    def merge(self, entries: Iterable[QuarantineEntry]) -> None:
        """Adds every entry of an etcd snapshot; entries held only here (written while etcd was
        away, not yet published) stay until they lapse."""
        for entry in entries:
            self.add(entry)
