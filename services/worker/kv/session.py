"""Session KV persistence through the cache service: restore a cached prefix, save after a turn.

`SessionKV` is what an engine talks to. It names blocks (chained hashes bound to the model
version and the tenant), asks the cache for the longest cached prefix, decides by measured
cost whether restoring beats recomputing, fetches the blocks, and queues saves that run in
the background. It never fails a request: with the cache down, slow or returning bad bytes,
the engine simply recomputes. While the cache is in use the worker follows its health stream
(gRPC health Watch: each change comes at once, nothing is sent while none comes); a failed
call or a lost stream takes the cache out of use, and a check every `probe_interval_s` brings it
back once it answers SERVING.
It knows nothing of tensors: the engine decodes fetched blocks and supplies an encoder.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from opentelemetry import context as otel_context

from services.cache.blocks import chain_hashes
from services.cache.client import FetchedBlocks, KVCacheClient, PutBlock
from services.cache.types import KVLayout, KVScope
from services.common import tracing
from services.common.errors import BallastError, DeadlineExceeded, Unavailable
from services.common.telemetry import DependencyStatus
from services.worker.kv.cost import CostModel
from services.worker.kv.metrics import KVMetrics
from services.worker.kv.saver import SaveQueue
from services.common.tasks import stop_task

log = logging.getLogger(__name__)
TRACER = tracing.tracer("worker")

DEPENDENCY = "kvcache"
# Encodes blocks [first, end) of a finished sequence into (bytes, CRC-32) pairs.
BlockEncoder = Callable[[int, int], Sequence[tuple[Any, int]]]


def restorable_blocks(context_tokens: int, block_tokens: int) -> int:
    """Blocks of a context a restore may cover: never its last token, whose logits the first
    new token needs, so that token is always computed fresh."""
    return max(0, (context_tokens - 1) // block_tokens)


@dataclass(frozen=True)
class KVSettings:
    block_tokens: int = 32
    policy: str = "adaptive"  # adaptive | always | never
    timeout_s: float = 0.5
    restore_timeout_s: float = 5.0
    save_timeout_s: float = 10.0
    ttl_s: int = 0
    save_queue: int = 8
    # How often a cache out of use is checked for its return.
    probe_interval_s: float = 1.0

    @classmethod
    def from_worker_config(cls, worker: Any) -> "KVSettings":
        return cls(
            block_tokens=worker.kv_block_tokens,
            policy=worker.kv_restore_policy,
            timeout_s=worker.kv_timeout_s,
            restore_timeout_s=worker.kv_restore_timeout_s,
            save_timeout_s=worker.kv_save_timeout_s,
            ttl_s=worker.kv_ttl_s,
            save_queue=worker.kv_save_queue,
        )


@dataclass
class _SaveJob:
    scope: KVScope
    token_ids: tuple[int, ...]
    encode: BlockEncoder
    # The turn's trace: the save runs later, in the background, but belongs to that turn.
    trace_context: otel_context.Context | None = None


@dataclass
class Fetch:
    """A restore in progress: the blocks fetched and when the restore began."""

    blocks: FetchedBlocks
    started: float


class SessionKV:
    def __init__(
        self,
        client: KVCacheClient,
        settings: KVSettings,
        metrics: KVMetrics,
        dependencies: DependencyStatus,
        health: Any = None,
        prefill_chunk: int = 512,
    ) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.cost = CostModel(prefill_chunk=prefill_chunk)
        self._dependencies = dependencies
        self._health = health
        self._version: str | None = None
        self._layout: KVLayout | None = None
        self._available = False
        self._queue: SaveQueue[_SaveJob] = SaveQueue(settings.save_queue)
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-save")
        self._tasks: list[asyncio.Task] = []
        self._watch_task: asyncio.Task | None = None
        dependencies.set(DEPENDENCY, False)
        metrics.watch(lambda: len(self._queue), self._estimates)

    # --- lifecycle ----------------------------------------------------------------------
    def bind(self, model_version: str, layout: KVLayout) -> None:
        """The model whose blocks this worker reads and writes."""
        self._version, self._layout = model_version, layout

    @property
    def layout(self) -> KVLayout | None:
        return self._layout

    @property
    def available(self) -> bool:
        return self._available

    async def start(self) -> None:
        await self._probe_once()
        self._tasks = [
            asyncio.create_task(self._probe_loop(), name="kvcache-probe"),
            asyncio.create_task(self._save_loop(), name="kvcache-save"),
        ]

    async def flush(self, timeout_s: float) -> bool:
        """Waits until every queued save is written (or given up); False on timeout."""
        return await self._queue.wait_idle(timeout_s)

    async def stop(self, flush_timeout_s: float = 5.0) -> None:
        """Writes what is queued (bounded by `flush_timeout_s`), then stops."""
        if self._available and not await self.flush(flush_timeout_s):
            log.warning("stopping with %d session saves unwritten", len(self._queue))
        for task in self._tasks:
            await stop_task(task)
        self._tasks = []
        self._encoder.shutdown(wait=False, cancel_futures=True)
        await self.client.close()

    # --- availability -------------------------------------------------------------------
    async def _set_available(self, up: bool) -> None:
        if up != self._available:
            log.info("kv cache %s", "reachable" if up else "unavailable: recomputing prefixes")
        self._available = up
        self._dependencies.set(DEPENDENCY, up)
        if self._health is not None:
            from grpc_health.v1 import health_pb2

            status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
            await self._health.set(DEPENDENCY, status)

    async def _probe_once(self) -> None:
        await self._set_available(await self.client.healthy(self.settings.timeout_s))

    async def _probe_loop(self) -> None:
        # While the cache is in use, its health Watch stream reports each change and costs
        # nothing while none comes (a Check every second cost an idle worker about 1 ms of CPU
        # a second); while it is not, a Check every probe_interval_s finds it back.
        while True:
            try:
                if self._available:
                    await self._follow_watch()
                else:
                    await asyncio.sleep(self.settings.probe_interval_s)
                    await self._probe_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv cache probe failed")
                await asyncio.sleep(self.settings.probe_interval_s)

    async def _follow_watch(self) -> None:
        """Follows the cache's health stream until it ends (the cache is gone) or a failed call
        takes the cache out of use (`_failed` cancels the watch)."""
        watch = asyncio.create_task(self._watch(), name="kvcache-health-watch")
        self._watch_task = watch
        try:
            await asyncio.wait({watch})
        finally:
            self._watch_task = None
            watch.cancel()
        if not watch.cancelled():
            watch.result()  # a watch that failed raises here, for the loop to log

    async def _watch(self) -> None:
        async for serving in self.client.watch_health():
            await self._set_available(serving)
        await self._set_available(False)

    async def _failed(self, error: BallastError) -> None:
        # A refused or broken call, or one past its deadline, means the cache (or its Redis)
        # is gone or not answering in time: stop asking until a check sees it back, so
        # requests do not each pay a timeout.
        if isinstance(error, (Unavailable, DeadlineExceeded)):
            await self._set_available(False)
            if self._watch_task is not None:
                self._watch_task.cancel()

    # --- restore ------------------------------------------------------------------------
    def scope(self, tenant: str) -> KVScope:
        assert self._version is not None
        return KVScope(self._version, tenant)

    def applies_to(self, session_id: str) -> bool:
        return bool(session_id) and self._layout is not None and self.settings.policy != "never"

    async def fetch(self, tenant: str, context: Sequence[int]) -> Fetch | None:
        """Fetches the longest cached prefix of `context` worth restoring; None to recompute."""
        with TRACER.start_as_current_span(
            "worker.kv_restore", attributes={"ballast.context_tokens": len(context)}
        ) as span:
            fetched = await self._fetch(tenant, context)
            span.set_attribute("ballast.kv.blocks", fetched.blocks.blocks if fetched is not None else 0)
            return fetched

    async def _fetch(self, tenant: str, context: Sequence[int]) -> Fetch | None:
        if not self._available:
            self.metrics.lookups.add(1, {"result": "unavailable"})
            return None
        layout = self._layout
        block = self.settings.block_tokens
        max_blocks = restorable_blocks(len(context), block)
        if max_blocks <= 0:
            return None
        adaptive = self.settings.policy == "adaptive"
        if adaptive and not self.cost.worth_lookup(max_blocks * block):
            self.metrics.lookups.add(1, {"result": "skipped"})
            return None
        scope = self.scope(tenant)
        hashes = chain_hashes(scope, block, context, max_blocks)
        started = time.perf_counter()
        try:
            cached = await self.client.lookup(scope, hashes, self.settings.timeout_s)
        except BallastError as error:
            self.metrics.lookups.add(1, {"result": "unavailable"})
            await self._failed(error)
            return None
        self.cost.observe_lookup((time.perf_counter() - started) * 1000)
        if cached == 0:
            self.metrics.lookups.add(1, {"result": "miss"})
            return None
        self.metrics.lookups.add(1, {"result": "hit"})
        tokens = cached * block
        timeout = self.settings.restore_timeout_s
        if adaptive:
            decision = self.cost.decide(tokens)
            self.metrics.decisions.add(
                1, {"choice": "restore" if decision.restore else "recompute", "reason": decision.reason}
            )
            if not decision.restore:
                return None
            if self.cost.restore_samples >= self.cost.min_restore_samples and self.cost.prefill_samples:
                # Past twice the recompute estimate a restore has lost; keep what arrived by then.
                timeout = min(timeout, max(0.05, 2 * decision.recompute_ms / 1000))
        else:
            self.metrics.decisions.add(1, {"choice": "restore", "reason": "policy"})
        fetched = await self.client.get(scope, hashes[:cached], layout, timeout)
        if fetched.error is not None:
            self.metrics.restore_failures.add(1, {"reason": "stream"})
            log.info("kv restore stopped after %d of %d blocks: %s", fetched.blocks, cached, fetched.error)
            await self._failed(fetched.error)
        return Fetch(fetched, started) if fetched.blocks else None

    def restored(self, fetch: Fetch, good_blocks: int) -> int:
        """Records a finished restore (after decoding); returns the tokens restored."""
        bad = fetch.blocks.blocks - good_blocks
        if bad:
            self.metrics.restore_failures.add(1, {"reason": "checksum"})
        tokens = good_blocks * self.settings.block_tokens
        ms = (time.perf_counter() - fetch.started) * 1000
        self.metrics.restore_ms.record(ms)
        # The time went on every fetched block, usable or not.
        self.cost.observe_restore(fetch.blocks.blocks * self.settings.block_tokens, ms)
        return tokens

    # --- save ---------------------------------------------------------------------------
    def save(self, tenant: str, session_id: str, token_ids: Sequence[int], encode: BlockEncoder) -> str:
        """Queues the session's full blocks for writing; returns at once with the outcome."""
        if self._layout is None or len(token_ids) < self.settings.block_tokens:
            return "skipped"
        if not self._available:
            self.metrics.saves.add(1, {"outcome": "unavailable"})
            return "unavailable"
        job = _SaveJob(self.scope(tenant), tuple(token_ids), encode, otel_context.get_current())
        outcome = self._queue.offer((tenant, session_id), job)
        if outcome != "queued":
            self.metrics.saves.add(1, {"outcome": outcome})
        return outcome

    async def _save_loop(self) -> None:
        while True:
            job = await self._queue.take()
            try:
                # asyncio.timeout, not wait_for: wait_for can swallow the cancel that stops us.
                async with asyncio.timeout(self.settings.save_timeout_s):
                    outcome = await self._save_one(job)
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                outcome = "error"
                log.warning("kv save gave up after %.1fs", self.settings.save_timeout_s)
            except BallastError as error:
                outcome = "unavailable" if isinstance(error, Unavailable) else "error"
                await self._failed(error)
            except Exception:
                outcome = "error"
                log.exception("kv save failed")
            finally:
                job = None  # type: ignore[assignment]  # drop tensor references at once
                self._queue.done()
            self.metrics.saves.add(1, {"outcome": outcome})

    async def _save_one(self, job: _SaveJob) -> str:
        with TRACER.start_as_current_span(
            "worker.kv_save", context=job.trace_context, attributes={"ballast.tokens": len(job.token_ids)}
        ) as span:
            outcome = await self._write(job)
            span.set_attribute("ballast.outcome", outcome)
            return outcome

    async def _write(self, job: _SaveJob) -> str:
        if not self._available:
            return "unavailable"
        started = time.perf_counter()
        block = self.settings.block_tokens
        hashes = chain_hashes(job.scope, block, job.token_ids)
        cached = await self.client.lookup(job.scope, hashes, self.settings.timeout_s)
        if cached >= len(hashes):
            return "unchanged"
        loop = asyncio.get_running_loop()
        encoded = await loop.run_in_executor(self._encoder, job.encode, cached, len(hashes))
        blocks = [PutBlock(cached + i, hashes[cached + i], payload, crc) for i, (payload, crc) in enumerate(encoded)]
        result = await self.client.put(
            job.scope, self._layout, blocks, self.settings.ttl_s, self.settings.save_timeout_s
        )
        self.metrics.saved_blocks.add(result.stored_blocks)
        self.metrics.save_ms.record((time.perf_counter() - started) * 1000)
        return "saved" if result.stored_blocks else "rejected"

    def _estimates(self) -> dict[str, float]:
        if not self.cost.restore_samples or not self.cost.prefill_samples:
            return {}
        return {"restore": self.cost.restore_ms(1024), "recompute": self.cost.recompute_ms(1024)}
