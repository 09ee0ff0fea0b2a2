"""KV blocks in Redis: one key per block, written and read in pipelined batches.

On a Redis Cluster the blocks of one prefix spread over every master (no hash tag): the KV
cache is the bulk of what Redis holds, and one tenant or one long conversation must not fill
one master. Every command names one key, so nothing crosses slots; a pipeline goes out as one
batch per master, in parallel.

Every block is written with a TTL (the Put's, else `cache.ttl_s`; reads refresh it): the Redis
it shares with the backfill evicts with volatile-lru, which takes only keys that have one, so
memory pressure falls on KV blocks and never on the backfill's better answers, which have none.

Every Redis call runs under a deadline; a Redis that is down, slow or out of memory becomes
Unavailable (or a rejected block), never a crash. Reads verify each record (records.py) off
the event loop and stop at the first block that cannot be served, deleting it when it is
corrupt or partial so the next writer can replace it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from redis import exceptions as redis_errors

from services.cache.metrics import CacheMetrics
from services.cache.records import Record, RecordMiss, decode_record, record_key
from services.cache.types import BlockHeader, KVLayout, KVScope
from services.common.errors import DeadlineExceeded, Unavailable
from services.common.redis_client import UNAVAILABLE_ERRORS, AnyRedis, count_keys, info_per_master

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreLimits:
    key_prefix: str
    ttl_s: int
    max_ttl_s: int
    batch_bytes: int


@dataclass
class PutOutcome:
    stored_blocks: int = 0
    stored_bytes: int = 0
    rejected_blocks: int = 0


class RedisKVStore:
    def __init__(self, client: AnyRedis, limits: StoreLimits, metrics: CacheMetrics) -> None:
        self._redis = client
        self._limits = limits
        self._metrics = metrics

    @asynccontextmanager
    async def _call(self, timeout_s: float, caller_bound: bool):
        """Bounds a Redis exchange; maps Redis failures to domain errors."""
        try:
            async with asyncio.timeout(timeout_s):
                yield
        except TimeoutError:
            if caller_bound:
                raise DeadlineExceeded("the caller's deadline passed while waiting for Redis") from None
            raise Unavailable("redis did not answer in time") from None
        except UNAVAILABLE_ERRORS as exc:
            raise Unavailable(f"redis unavailable: {exc}") from None

    def key(self, scope: KVScope, block_hash: bytes) -> str:
        return record_key(self._limits.key_prefix, scope, block_hash)

    def ttl_for(self, asked_s: int) -> int:
        """Never 0: a block without a TTL would be out of volatile-lru's reach."""
        return max(1, min(asked_s or self._limits.ttl_s, self._limits.max_ttl_s))

    async def lookup(
        self, scope: KVScope, hashes: Sequence[bytes], timeout_s: float, caller_bound: bool = False
    ) -> int:
        if not hashes:
            return 0
        async with self._call(timeout_s, caller_bound):
            pipe = self._redis.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(scope, h))
            present = await pipe.execute()
        for i, found in enumerate(present):
            if not found:
                return i
        return len(hashes)

    async def put(
        self,
        scope: KVScope,
        blocks: Sequence[tuple[BlockHeader, bytes]],
        ttl_s: int,
        timeout_s: float,
        caller_bound: bool = False,
    ) -> PutOutcome:
        """Writes verified blocks in one pipeline; a block Redis has no room for is rejected."""
        outcome = PutOutcome()
        if not blocks:
            return outcome
        async with self._call(timeout_s, caller_bound):
            pipe = self._redis.pipeline(transaction=False)
            for header, record in blocks:
                pipe.set(self.key(scope, header.block_hash), record, ex=self.ttl_for(ttl_s))
            results = await pipe.execute(raise_on_error=False)
        for (header, _record), result in zip(blocks, results):
            if isinstance(result, UNAVAILABLE_ERRORS):
                # Checked first: a slot without a master is a ResponseError too.
                raise Unavailable(f"redis unavailable: {result}")
            if isinstance(result, redis_errors.ResponseError):
                # OOM under maxmemory with a no-eviction policy, or a value over the bound.
                log.warning("redis refused block %d: %s", header.block_index, result)
                outcome.rejected_blocks += 1
                self._metrics.rejected("no_room")
            elif isinstance(result, Exception):
                raise Unavailable(f"redis unavailable: {result}")
            else:
                outcome.stored_blocks += 1
                outcome.stored_bytes += header.size
                self._metrics.stored(header.size)
        return outcome

    async def get(
        self, scope: KVScope, hashes: Sequence[bytes], layout: KVLayout, deadline: float, caller_bound: bool = False
    ) -> AsyncIterator[Record]:
        """Yields verified records of blocks 0, 1, ... until the first one that cannot be served.

        `deadline` is a time.monotonic() instant bounding every Redis batch. The next batch
        is read from Redis while the current one streams out (at most two in memory)."""
        per_batch = max(1, self._limits.batch_bytes // max(1, layout.block_bytes))
        batches = [(start, hashes[start : start + per_batch]) for start in range(0, len(hashes), per_batch)]
        if not batches:
            return
        pending = asyncio.create_task(self._read_batch(scope, batches[0][1], deadline, caller_bound))
        try:
            for i, (start, batch) in enumerate(batches):
                raws = await pending
                if i + 1 < len(batches):
                    pending = asyncio.create_task(self._read_batch(scope, batches[i + 1][1], deadline, caller_bound))
                records, miss = await asyncio.to_thread(self._verify, scope, batch, start, raws, layout)
                self._metrics.hit(len(records), sum(r.header.size for r in records))
                for record in records:
                    yield record
                if miss is not None:
                    index, reason = miss
                    self._metrics.miss(reason)
                    if reason in ("corrupt", "partial"):
                        await self._discard(scope, hashes[index], deadline, caller_bound)
                    return
        finally:
            # Stop a read-ahead nobody will use; collect its outcome so no error goes unseen.
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)

    async def _read_batch(self, scope: KVScope, batch: Sequence[bytes], deadline: float, caller_bound: bool) -> list:
        async with self._call(max(0.0, deadline - time.monotonic()), caller_bound):
            pipe = self._redis.pipeline(transaction=False)
            for h in batch:
                # Reading refreshes the TTL: a live session's blocks stay while it is used.
                pipe.getex(self.key(scope, h), ex=self._limits.ttl_s)
            return await pipe.execute()

    def _verify(
        self, scope: KVScope, batch: Sequence[bytes], first_index: int, raws: list, layout: KVLayout
    ) -> tuple[list[Record], tuple[int, str] | None]:
        records = []
        for offset, (h, raw) in enumerate(zip(batch, raws)):
            index = first_index + offset
            if raw is None:
                return records, (index, "absent")
            try:
                records.append(decode_record(raw, scope, h, index, layout))
            except RecordMiss as miss:
                log.warning("block %d of %s is unusable (%s)", index, scope.model_version, miss)
                return records, (index, miss.reason)
        return records, None

    async def _discard(self, scope: KVScope, block_hash: bytes, deadline: float, caller_bound: bool) -> None:
        try:
            async with self._call(max(0.05, deadline - time.monotonic()), caller_bound):
                await self._redis.delete(self.key(scope, block_hash))
        except (Unavailable, DeadlineExceeded):
            pass  # it stays a miss either way; the next writer overwrites it

    async def delete(
        self, scope: KVScope, hashes: Sequence[bytes], timeout_s: float, caller_bound: bool = False
    ) -> int:
        if not hashes:
            return 0
        async with self._call(timeout_s, caller_bound):
            return int(await self._redis.delete(*(self.key(scope, h) for h in hashes)))

    async def redis_stats(self, timeout_s: float, caller_bound: bool = False) -> dict[str, int]:
        """Keys, memory and evictions of the server (of all masters together on a cluster)."""
        async with self._call(timeout_s, caller_bound):
            keys = await count_keys(self._redis)
            memory = await info_per_master(self._redis, "memory")
            stats = await info_per_master(self._redis, "stats")
        return {
            "keys": keys,
            "used_memory": sum(int(m.get("used_memory", 0)) for m in memory),
            "maxmemory": sum(int(m.get("maxmemory", 0)) for m in memory),
            "evicted_keys": sum(int(s.get("evicted_keys", 0)) for s in stats),
        }
