"""The async client of `ballast.v1.KVCache`, for workers, tests and benchmarks.

Every call takes a deadline. gRPC failures become the typed errors of services.common.errors
(UNAVAILABLE -> Unavailable, ...), so a caller can treat any of them as "no cache right now".
`get` keeps whatever whole blocks arrived before a failure: a prefix is still usable.
Blocks are checked against the request on arrival (position, hash, layout, size) and land
back to back in one buffer; their checksums are verified by `FetchedBlocks.verified_prefix()`,
which callers run off the loop.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ballast.v1 import kvcache_pb2, kvcache_pb2_grpc
from services.cache.framing import pack
from services.cache.types import BlockHeader, KVLayout, KVScope
from services.common.errors import (
    BallastError,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from services.common.grpc_tracing import client_interceptors
from services.common.tls.credentials import open_channel
from services.common.tls.settings import TLSConfig

SERVICE_NAME = "ballast.v1.KVCache"
DEFAULT_CHUNK_BYTES = 1 << 20


def error_from_rpc(exc: grpc.aio.AioRpcError) -> BallastError:
    code = exc.code()
    message = f"kv cache: {exc.details() or code.name}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(message)
    return Unavailable(message)


@dataclass(frozen=True)
class PutBlock:
    index: int
    block_hash: bytes
    payload: bytes | bytearray | memoryview
    crc32: int


@dataclass
class PutResult:
    stored_blocks: int
    stored_bytes: int
    rejected_blocks: int


@dataclass
class FetchedBlocks:
    """Whole blocks 0..n-1 of a Get, back to back in one buffer (no per-block copies)."""

    layout: KVLayout
    buffer: bytearray
    headers: list[BlockHeader] = field(default_factory=list)
    # Set when the stream broke; the blocks before the break are still whole.
    error: BallastError | None = None

    @property
    def blocks(self) -> int:
        return len(self.headers)

    def payload(self, i: int) -> memoryview:
        size = self.layout.block_bytes
        return memoryview(self.buffer)[i * size : (i + 1) * size]

    def verified_prefix(self) -> int:
        """Leading blocks whose bytes match their checksum (CPU work: call it off the loop)."""
        for i, header in enumerate(self.headers):
            if zlib.crc32(self.payload(i)) != header.crc32:
                return i
        return len(self.headers)


class KVCacheClient:
    def __init__(self, address: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, tls: TLSConfig | None = None) -> None:
        self.address = address
        self._chunk = chunk_bytes
        # The caller's span (a worker's restore or save) is the parent of the cache's.
        self._channel = open_channel(address, tls, interceptors=client_interceptors())
        self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def healthy(self, timeout_s: float) -> bool:
        """True when the service answers SERVING (it does only while its Redis is up)."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def watch_health(self) -> AsyncIterator[bool]:
        """Whether the service is SERVING: now, then at each change (it serves only while its
        Redis is up). Ends when the stream does: the service stopped or cannot be reached."""
        call = self._health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        try:
            async for reply in call:
                yield reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return
        finally:
            call.cancel()

    async def lookup(self, scope: KVScope, hashes: Sequence[bytes], timeout_s: float) -> int:
        try:
            reply = await self._stub.Lookup(
                kvcache_pb2.KVLookupRequest(scope=scope.to_pb(), block_hashes=list(hashes)), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        return min(reply.cached_blocks, len(hashes))

    async def delete(self, scope: KVScope, hashes: Sequence[bytes], timeout_s: float) -> int:
        try:
            reply = await self._stub.Delete(
                kvcache_pb2.KVDeleteRequest(scope=scope.to_pb(), block_hashes=list(hashes)), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        return reply.deleted_blocks

    async def stats(self, timeout_s: float) -> kvcache_pb2.KVStatsReply:
        try:
            return await self._stub.Stats(kvcache_pb2.KVStatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def get(self, scope: KVScope, hashes: Sequence[bytes], layout: KVLayout, timeout_s: float) -> FetchedBlocks:
        """The longest servable prefix of `hashes`; never raises for a broken stream."""
        size = layout.block_bytes
        fetched = FetchedBlocks(layout, bytearray(len(hashes) * size))
        call = self._stub.Get(
            kvcache_pb2.KVGetRequest(scope=scope.to_pb(), block_hashes=list(hashes), layout=layout.to_pb()),
            timeout=timeout_s,
        )
        announced: list[BlockHeader] = []
        received = 0  # bytes of announced blocks, written back to back into the buffer
        try:
            async for reply in call:
                for pb in reply.headers:
                    header = BlockHeader.from_pb(pb)
                    i = len(announced)
                    if (
                        i >= len(hashes)
                        or header.block_index != i
                        or header.block_hash != hashes[i]
                        or header.layout != layout
                        or header.size != size
                    ):
                        raise _Broken(f"kv cache sent an unexpected block header at block {i}")
                    announced.append(header)
                data = reply.data
                if received + len(data) > len(announced) * size:
                    raise _Broken("kv cache sent bytes for a block it did not announce")
                fetched.buffer[received : received + len(data)] = data
                received += len(data)
                fetched.headers = announced[: received // size]
        except _Broken as broken:
            fetched.error = Unavailable(str(broken))
        except grpc.aio.AioRpcError as exc:
            fetched.error = error_from_rpc(exc)
        finally:
            call.cancel()  # no-op when finished; frees the server's work when we stopped early
        return fetched

    async def put(
        self, scope: KVScope, layout: KVLayout, blocks: Sequence[PutBlock], ttl_s: int, timeout_s: float
    ) -> PutResult:
        async def requests() -> AsyncIterator[kvcache_pb2.KVPutRequest]:
            for message in put_messages(scope, layout, blocks, ttl_s, self._chunk):
                yield message

        try:
            reply = await self._stub.Put(requests(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        return PutResult(reply.stored_blocks, reply.stored_bytes, reply.rejected_blocks)


def put_messages(
    scope: KVScope, layout: KVLayout, blocks: Sequence[PutBlock], ttl_s: int, chunk_bytes: int
) -> Iterator[kvcache_pb2.KVPutRequest]:
    """The Put stream: `open` in the first message, then the blocks framed by framing.pack."""
    layout_pb = layout.to_pb()
    headers = (
        kvcache_pb2.KVBlockHeader(
            block_hash=b.block_hash,
            block_index=b.index,
            layout=layout_pb,
            size=memoryview(b.payload).nbytes,
            crc32=b.crc32,
        )
        for b in blocks
    )
    open_ = kvcache_pb2.KVPutOpen(scope=scope.to_pb(), ttl_s=ttl_s)
    first = True
    for message_headers, data in pack(zip(headers, (b.payload for b in blocks)), chunk_bytes):
        yield kvcache_pb2.KVPutRequest(open=open_ if first else None, headers=message_headers, data=data)
        first = False
    if first:
        yield kvcache_pb2.KVPutRequest(open=open_)


class _Broken(Exception):
    """The Get stream broke the framing rules; keep the whole blocks received before."""
