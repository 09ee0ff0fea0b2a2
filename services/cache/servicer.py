"""`ballast.v1.KVCache`: request validation, chunked streaming, and protobuf <-> domain.

Put and Get move blocks framed as in framing.py, in messages of at most `chunk_bytes`, so no
message grows with the block size. A Put block is verified against its checksum before it is
written; a stream that is cut short or overruns its headers is bad input, and the block it
broke off in is not stored.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from typing import AsyncIterator

import grpc
from opentelemetry import trace

from ballast.v1 import kvcache_pb2, kvcache_pb2_grpc
from services.cache.framing import Packer, Unpacker
from services.cache.metrics import CacheMetrics
from services.cache.records import encode_record
from services.cache.settings import CacheConfig
from services.cache.store import PutOutcome, RedisKVStore
from services.cache.types import BlockHeader, KVLayout, KVScope, check_block_hashes
from services.common.config import RedisConfig
from services.common.errors import InvalidArgument


# Above this a block's checksum is computed in a thread, so the loop keeps serving others.
_THREAD_CRC_BYTES = 1 << 20


def _crc32(data: bytes | bytearray) -> int:
    return zlib.crc32(data)


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(
        self, store: RedisKVStore, config: CacheConfig, redis_config: RedisConfig, metrics: CacheMetrics
    ) -> None:
        self.store = store
        self.config = config
        self.redis_timeout_s = redis_config.timeout_s
        self.metrics = metrics

    def _budget(self, context: grpc.aio.ServicerContext, floor_s: float) -> tuple[float, bool]:
        """Seconds this call may spend on Redis, and whether the caller's deadline is the bound."""
        remaining = context.time_remaining()
        own = max(floor_s, self.redis_timeout_s)
        if remaining is not None and remaining < own:
            return max(0.0, remaining), True
        return own, False

    def _hashes(self, values) -> list[bytes]:
        return check_block_hashes(values, self.config.max_blocks_per_call)

    # --- unary -------------------------------------------------------------------------
    async def Lookup(self, request: kvcache_pb2.KVLookupRequest, context) -> kvcache_pb2.KVLookupReply:
        started = time.perf_counter()
        scope = KVScope.from_pb(request.scope)
        hashes = self._hashes(request.block_hashes)
        timeout, bound = self._budget(context, 0)
        cached = await self.store.lookup(scope, hashes, timeout, bound)
        self.metrics.latency.record((time.perf_counter() - started) * 1000, {"method": "Lookup"})
        # The call's server span (see grpc_tracing): what was asked and found.
        trace.get_current_span().set_attributes({"ballast.kv.blocks": len(hashes), "ballast.kv.cached": cached})
        return kvcache_pb2.KVLookupReply(cached_blocks=cached)

    async def Delete(self, request: kvcache_pb2.KVDeleteRequest, context) -> kvcache_pb2.KVDeleteReply:
        scope = KVScope.from_pb(request.scope)
        hashes = self._hashes(request.block_hashes)
        timeout, bound = self._budget(context, 0)
        deleted = await self.store.delete(scope, hashes, timeout, bound)
        return kvcache_pb2.KVDeleteReply(deleted_blocks=deleted)

    async def Stats(self, request: kvcache_pb2.KVStatsRequest, context) -> kvcache_pb2.KVStatsReply:
        timeout, bound = self._budget(context, 0)
        redis = await self.store.redis_stats(timeout, bound)
        totals = self.metrics.totals
        reply = kvcache_pb2.KVStatsReply(
            blocks=redis["keys"],
            used_memory_bytes=redis["used_memory"],
            max_memory_bytes=redis["maxmemory"],
            evicted_keys=redis["evicted_keys"],
            hits=totals.hits,
            misses=totals.misses,
            checksum_failures=totals.checksum_failures,
            bytes_stored=totals.bytes_stored,
            bytes_served=totals.bytes_served,
        )
        cluster = self.metrics.cluster
        if cluster is not None:
            reply.redis_cluster.CopyFrom(
                kvcache_pb2.RedisClusterHealth(
                    state_ok=cluster.state_ok,
                    slots_ok=cluster.slots_ok,
                    masters=cluster.masters,
                    masters_reachable=cluster.masters_reachable,
                    known_nodes=cluster.known_nodes,
                )
            )
        return reply

    # --- Get: server stream (errors mapped by the interceptor) ----------------------------
    async def Get(self, request: kvcache_pb2.KVGetRequest, context) -> AsyncIterator[kvcache_pb2.KVGetReply]:
        started = time.perf_counter()
        scope = KVScope.from_pb(request.scope)
        hashes = self._hashes(request.block_hashes)
        layout = KVLayout.from_pb(request.layout).validate(self.config.max_block_bytes)
        # A whole Get may take longer than one Redis call: give it the caller's time, or a
        # multiple of the Redis timeout when the caller set no deadline.
        remaining = context.time_remaining()
        own = self.redis_timeout_s * max(1, math.ceil(len(hashes) * layout.block_bytes / self.config.batch_bytes))
        bound = remaining is not None and remaining < own
        deadline = time.monotonic() + (remaining if bound else own)
        packer = Packer(self.config.chunk_bytes)
        served = 0
        async for record in self.store.get(scope, hashes, layout, deadline, bound):
            served += 1
            for headers, data in packer.add(record.header.to_pb(), record.payload):
                yield kvcache_pb2.KVGetReply(headers=headers, data=data)
        last = packer.finish()
        if last is not None:
            yield kvcache_pb2.KVGetReply(headers=last[0], data=last[1])
        self.metrics.latency.record((time.perf_counter() - started) * 1000, {"method": "Get"})
        trace.get_current_span().set_attributes({"ballast.kv.blocks": len(hashes), "ballast.kv.served": served})

    # --- Put: client stream (the interceptor maps its errors and refuses bad frames) -----
    async def Put(self, request_iterator, context) -> kvcache_pb2.KVPutReply:
        started = time.perf_counter()
        outcome = await self._put(request_iterator, context)
        self.metrics.latency.record((time.perf_counter() - started) * 1000, {"method": "Put"})
        trace.get_current_span().set_attributes(
            {"ballast.kv.stored": outcome.stored_blocks, "ballast.kv.rejected": outcome.rejected_blocks}
        )
        return kvcache_pb2.KVPutReply(
            stored_blocks=outcome.stored_blocks,
            stored_bytes=outcome.stored_bytes,
            rejected_blocks=outcome.rejected_blocks,
        )

    async def _put(self, requests, context) -> PutOutcome:
        outcome = PutOutcome()
        scope: KVScope | None = None
        ttl_s = 0
        unpacker = Unpacker(lambda header: header.size, self.config.max_blocks_per_call)
        pending: list[tuple[BlockHeader, bytes]] = []
        pending_bytes = 0

        async def flush() -> None:
            nonlocal pending, pending_bytes
            if pending:
                timeout, bound = self._budget(context, 0)
                done = await self.store.put(scope, pending, ttl_s, timeout, bound)
                outcome.stored_blocks += done.stored_blocks
                outcome.stored_bytes += done.stored_bytes
                outcome.rejected_blocks += done.rejected_blocks
                pending, pending_bytes = [], 0

        async for message in requests:
            if scope is None:
                if not message.HasField("open"):
                    raise InvalidArgument("the first Put message must carry `open`")
                scope = KVScope.from_pb(message.open.scope)
                ttl_s = message.open.ttl_s
            elif message.HasField("open"):
                raise InvalidArgument("`open` may only be in the first Put message")
            headers = [BlockHeader.from_pb(h).validate(self.config.max_block_bytes) for h in message.headers]
            for header, payload in unpacker.feed(headers, message.data):
                crc = await asyncio.to_thread(_crc32, payload) if header.size >= _THREAD_CRC_BYTES else _crc32(payload)
                if crc != header.crc32:
                    outcome.rejected_blocks += 1
                    self.metrics.rejected("checksum")
                    continue
                pending.append((header, encode_record(scope, header, payload)))
                pending_bytes += header.size
                if pending_bytes >= self.config.batch_bytes:
                    await flush()
        if scope is None:
            raise InvalidArgument("empty Put: the first message must carry `open`")
        await flush()  # whole blocks are stored even when the stream ends badly
        unfinished = unpacker.pending()
        if unfinished is not None:
            raise InvalidArgument(f"the Put stream ended early: {unfinished}; that block was not stored")
        return outcome
