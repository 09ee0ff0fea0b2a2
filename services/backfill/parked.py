"""The parked tickets: degraded requests the backfill gave up on, listed where an operator
(`ballast status`) can read them.

The records themselves go to the dead-letter topic; this keeps a short summary of the latest
`max_entries` in one Redis list (`<redis_prefix>parked`), newest first: the ticket, the
tenant, why (attempts, quarantined, invalid), how many attempts and when. No prompt text.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from services.common.redis_client import AnyRedis

PARKED_KEY = "parked"
DEFAULT_MAX_ENTRIES = 200


@dataclass(frozen=True)
class ParkedTicket:
    ticket: str
    tenant: str
    cause: str
    attempts: int
    at: float
    error: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> "ParkedTicket | None":
        try:
            data = json.loads(raw)
            return cls(
                ticket=str(data["ticket"]),
                tenant=str(data["tenant"]),
                cause=str(data["cause"]),
                attempts=int(data["attempts"]),
                at=float(data["at"]),
                error=str(data.get("error", "")),
            )
        except (ValueError, KeyError, TypeError):
            return None


def parked_key(redis_prefix: str) -> str:
    return f"{redis_prefix}{PARKED_KEY}"


class ParkedTickets:
    """The bounded list of parked tickets in Redis."""

    def __init__(self, client: AnyRedis, redis_prefix: str, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.client = client
        self.key = parked_key(redis_prefix)
        self.max_entries = max_entries

    async def add(self, ticket: str, tenant: str, cause: str, attempts: int, error: str = "") -> None:
        entry = ParkedTicket(ticket, tenant, cause, attempts, time.time(), error[:200])
        await self.client.lpush(self.key, entry.to_json())
        await self.client.ltrim(self.key, 0, self.max_entries - 1)

    async def latest(self, count: int = 20) -> list[ParkedTicket]:
        return read_parked(await self.client.lrange(self.key, 0, max(0, count - 1)))


def read_parked(values: list[bytes | str]) -> list[ParkedTicket]:
    """Parked tickets from the list's raw values (a value that does not parse is skipped)."""
    return [entry for entry in (ParkedTicket.from_json(v) for v in values) if entry is not None]
