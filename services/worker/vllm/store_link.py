"""Blocking calls to the cache service from inside vLLM's engine processes.

vLLM calls its KV connector synchronously, from its scheduler loop and its model runner, so
the connector cannot await. `StoreLink` runs Ballast's async cache client on a private event
loop in a daemon thread and lets callers block on it with a deadline: lookups and fetches
wait (bounded by `worker.kv_timeout_s` and `worker.kv_restore_timeout_s`), saves do not (at
most `save_queue` in flight; more are dropped and counted).

It never raises into vLLM. A failed call marks the store down for `retry_after_s`: lookups
then answer 0 at once (the request recomputes) instead of each paying a timeout, and the
next call after that tries again. Every outcome is counted in `ConnectorCounters`, which the
connector hands to vLLM's stats and the worker turns into its KV metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any, Coroutine, Sequence

from services.cache.client import FetchedBlocks, KVCacheClient, PutBlock
from services.cache.types import KVLayout, KVScope
from services.common.errors import BallastError
from services.worker.vllm.connector_config import StoreSettings

log = logging.getLogger(__name__)


class ConnectorCounters:
    """Counts by name ("lookups.hit", "saves.dropped", ...), taken and reset by stats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + amount

    def take(self) -> dict[str, float]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts


class StoreLink:
    def __init__(self, settings: StoreSettings, counters: ConnectorCounters | None = None) -> None:
        self.settings = settings
        self.counters = counters or ConnectorCounters()
        self._down_until = 0.0
        self._saves = threading.BoundedSemaphore(max(1, settings.save_queue))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ballast-kv-store", daemon=True)
        self._thread.start()
        self._client: KVCacheClient = self._call(self._open(), 5.0)

    async def _open(self) -> KVCacheClient:
        # The channel binds to this loop.
        return KVCacheClient(self.settings.address, tls=self.settings.tls())

    def _call(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        future: Future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            future.cancel()
            raise

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, error: BaseException) -> None:
        if self.up:
            log.info("kv cache unavailable (%s: %s): recomputing for %.1fs", what, error, self.settings.retry_after_s)
        self._down_until = time.monotonic() + self.settings.retry_after_s

    def lookup(self, scope: KVScope, names: Sequence[bytes]) -> int:
        """Leading blocks of `names` the store holds; 0 when it cannot say in time."""
        if not self.up:
            self.counters.add("lookups.unavailable")
            return 0
        timeout = self.settings.timeout_s
        try:
            cached = self._call(self._client.lookup(scope, names, timeout), timeout + 0.5)
        except (BallastError, FutureTimeout) as error:
            self.counters.add("lookups.unavailable")
            self._failed("lookup", error)
            return 0
        self.counters.add("lookups.hit" if cached else "lookups.miss")
        return int(cached)

    def get(self, scope: KVScope, names: Sequence[bytes], layout: KVLayout) -> FetchedBlocks | None:
        """The blocks (a leading part of them when the stream broke); None on no answer."""
        timeout = self.settings.restore_timeout_s
        try:
            fetched: FetchedBlocks = self._call(self._client.get(scope, names, layout, timeout), timeout + 0.5)
        except FutureTimeout as error:
            self.counters.add("restore_failures.stream")
            self._failed("get", error)
            return None
        if fetched.error is not None:
            self.counters.add("restore_failures.stream")
            self._failed("get", fetched.error)
        return fetched

    def put(self, scope: KVScope, layout: KVLayout, blocks: Sequence[PutBlock]) -> None:
        """Writes blocks in the background; drops them when `save_queue` saves are in flight."""
        if not self.up:
            self.counters.add("saves.unavailable")
            return
        if not self._saves.acquire(blocking=False):
            self.counters.add("saves.dropped")
            return
        future = asyncio.run_coroutine_threadsafe(self._put(scope, layout, blocks), self._loop)
        future.add_done_callback(lambda _f: self._saves.release())

    async def _put(self, scope: KVScope, layout: KVLayout, blocks: Sequence[PutBlock]) -> None:
        started = time.perf_counter()
        try:
            result = await self._client.put(scope, layout, blocks, self.settings.ttl_s, self.settings.save_timeout_s)
        except BallastError as error:
            self.counters.add("saves.unavailable")
            self._failed("put", error)
            return
        except Exception:
            self.counters.add("saves.error")
            log.exception("kv save failed")
            return
        self.counters.add("saves.saved" if result.stored_blocks else "saves.rejected")
        self.counters.add("saved_blocks", result.stored_blocks)
        self.counters.add("save_ms", (time.perf_counter() - started) * 1000)

    def close(self) -> None:
        try:
            self._call(self._client.close(), 2.0)
        except Exception:
            log.debug("closing the kv cache channel", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)
