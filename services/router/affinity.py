"""Session affinity: remembers which worker last served each (tenant, session).

That worker holds the session's KV in memory, so the next turn costs it no prefill. The
scheduler prefers it only while it is routable and has a free slot; otherwise any worker
takes the turn and restores the KV from the cache service. Bounded: least recently used
sessions are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict


class SessionAffinity:
    def __init__(self, max_sessions: int = 100_000) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self._max = max_sessions
        self._last: OrderedDict[tuple[str, str], str] = OrderedDict()

    def preferred(self, tenant: str, session_id: str) -> str | None:
        if not session_id:
            return None
        key = (tenant, session_id)
        worker = self._last.get(key)
        if worker is not None:
            self._last.move_to_end(key)
        return worker

    def served(self, tenant: str, session_id: str, worker_id: str) -> None:
        if not session_id:
            return
        key = (tenant, session_id)
        self._last[key] = worker_id
        self._last.move_to_end(key)
        while len(self._last) > self._max:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)
