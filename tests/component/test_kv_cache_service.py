"""The KV-cache service on port 0 against a real Redis: chunked put/get, prefix lookup,
isolation by model version and tenant, corrupt and partial entries, TTL, bad input, Redis
loss and return, and eviction under Redis's memory bound."""

from __future__ import annotations

import asyncio
import uuid
import zlib

import grpc
import pytest
import pytest_asyncio
import redis as redis_sync
from redis.cluster import RedisCluster
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ballast.v1 import kvcache_pb2, kvcache_pb2_grpc
from services.cache.app import create_server
from services.cache.blocks import chain_hashes
from services.cache.client import KVCacheClient, PutBlock
from services.cache.records import record_key
from services.cache.types import KVLayout, KVScope
from services.common.errors import InvalidArgument, Unavailable
from services.common.grpc_server import CHANNEL_OPTIONS
from services.cli.localservers import RedisServer
from services.config import load_config

SCOPE = KVScope("modelv1", "acme")
# 2 layers x 2 x 2 heads x 16 tokens x 16 dims x 4 bytes = 8 KiB: two chunks of 4 KiB each.
LAYOUT = KVLayout("float32", (2, 2, 2, 16, 16), 2, 16)
CHUNK = 4096


def make_config(redis_url: str, prefix: str, **extra: str):
    environ = {
        "BALLAST__REDIS__URL": redis_url,
        "BALLAST__REDIS__TIMEOUT_S": "0.5",
        "BALLAST__CACHE__PORT": "0",
        "BALLAST__CACHE__KEY_PREFIX": prefix,
        "BALLAST__CACHE__CHUNK_BYTES": str(CHUNK),
        "BALLAST__CACHE__BATCH_BYTES": str(3 * LAYOUT.block_bytes),  # several pipeline batches
        "BALLAST__TELEMETRY__METRICS_PORT": "0",
        **extra,
    }
    return load_config(environ=environ)


def blocks_for(scope: KVScope, count: int, seed: int = 0) -> tuple[list[bytes], list[PutBlock]]:
    tokens = [(seed * 7919 + i) % 500 for i in range(count * LAYOUT.block_tokens)]
    hashes = chain_hashes(scope, LAYOUT.block_tokens, tokens)
    blocks = []
    for i, h in enumerate(hashes):
        payload = bytes((seed + i + j) % 256 for j in range(LAYOUT.block_bytes))
        blocks.append(PutBlock(i, h, payload, zlib.crc32(payload)))
    return hashes, blocks


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module", params=["server", "cluster"])
def backend(request) -> tuple[str, bool]:
    """Redis URL and whether it is a cluster: one Redis server, and a Redis Cluster of three
    masters (a session's blocks spread over all three)."""
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster").url, True
    return request.getfixturevalue("redis_server").url, False


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cache(backend):
    url, cluster = backend
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    app = await create_server(make_config(url, prefix, BALLAST__REDIS__CLUSTER=str(cluster).lower()))
    yield app
    await app.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(loop_scope="session")
async def client(cache):
    c = KVCacheClient(cache.address, chunk_bytes=CHUNK)
    yield c
    await c.close()


@pytest.fixture(scope="module")
def raw_redis(backend):
    url, cluster = backend
    r = RedisCluster.from_url(url) if cluster else redis_sync.Redis.from_url(url)
    yield r
    r.close()


async def test_put_lookup_get_delete_round_trip(cache, client):
    hashes, blocks = blocks_for(SCOPE, 7, seed=1)
    result = await client.put(SCOPE, LAYOUT, blocks, 0, 5)
    assert (result.stored_blocks, result.rejected_blocks) == (7, 0)
    assert result.stored_bytes == 7 * LAYOUT.block_bytes
    assert await client.lookup(SCOPE, hashes, 1) == 7
    # The longest cached prefix: unknown blocks after the cached ones do not count.
    other, _ = blocks_for(SCOPE, 9, seed=99)
    assert await client.lookup(SCOPE, hashes + other[7:], 1) == 7
    fetched = await client.get(SCOPE, hashes, LAYOUT, 5)
    assert fetched.error is None and fetched.blocks == 7 and fetched.verified_prefix() == 7
    assert all(bytes(fetched.payload(i)) == blocks[i].payload for i in range(7))
    assert await client.delete(SCOPE, hashes[3:], 1) == 4
    assert await client.lookup(SCOPE, hashes, 1) == 3
    assert (await client.get(SCOPE, hashes, LAYOUT, 5)).blocks == 3
    stats = await client.stats(1)
    assert stats.hits >= 10 and stats.bytes_stored >= 7 * LAYOUT.block_bytes and stats.blocks >= 3


async def test_get_messages_stay_within_the_chunk_size(cache):
    hashes, blocks = blocks_for(SCOPE, 2, seed=2)
    client = KVCacheClient(cache.address)
    try:
        await client.put(SCOPE, LAYOUT, blocks, 0, 5)
    finally:
        await client.close()
    async with grpc.aio.insecure_channel(cache.address, options=CHANNEL_OPTIONS) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        replies = [
            r
            async for r in stub.Get(
                kvcache_pb2.KVGetRequest(scope=SCOPE.to_pb(), block_hashes=hashes, layout=LAYOUT.to_pb()), timeout=5
            )
        ]
    assert [len(r.headers) for r in replies] == [1, 0, 1, 0]  # each 8 KiB block spans two messages
    assert [r.headers[0].block_index for r in replies if r.headers] == [0, 1]
    assert all(len(r.data) == CHUNK for r in replies)


async def test_other_model_versions_and_tenants_never_see_the_blocks(client):
    hashes, blocks = blocks_for(SCOPE, 3, seed=3)
    await client.put(SCOPE, LAYOUT, blocks, 0, 5)
    for scope in (KVScope("modelv2", "acme"), KVScope("modelv1", "globex")):
        # Even when asked under the very same block names.
        assert await client.lookup(scope, hashes, 1) == 0
        assert (await client.get(scope, hashes, LAYOUT, 5)).blocks == 0


async def test_a_layout_the_asker_cannot_load_is_a_miss(cache, client):
    hashes, blocks = blocks_for(SCOPE, 2, seed=4)
    await client.put(SCOPE, LAYOUT, blocks, 0, 5)
    half = KVLayout("float16", (2, 2, 2, 16, 32), 2, 16)  # same byte size, other meaning
    before = metric(cache.telemetry.render(), "ballast_cache_misses_total", reason="mismatch")
    assert (await client.get(SCOPE, hashes, half, 5)).blocks == 0
    assert metric(cache.telemetry.render(), "ballast_cache_misses_total", reason="mismatch") == before + 1
    assert (await client.get(SCOPE, hashes, LAYOUT, 5)).blocks == 2  # still there for its own kind


async def test_flipped_bytes_in_redis_are_a_miss_and_removed(cache, client, raw_redis):
    hashes, blocks = blocks_for(SCOPE, 5, seed=5)
    await client.put(SCOPE, LAYOUT, blocks, 0, 5)
    key = record_key(cache.config.cache.key_prefix, SCOPE, hashes[2])
    raw = bytearray(raw_redis.get(key))
    raw[-100] ^= 0xFF
    raw_redis.set(key, bytes(raw))
    failures = metric(cache.telemetry.render(), "ballast_cache_checksum_failures_total")
    fetched = await client.get(SCOPE, hashes, LAYOUT, 5)
    assert fetched.blocks == 2 and fetched.verified_prefix() == 2  # never the bad block
    assert metric(cache.telemetry.render(), "ballast_cache_checksum_failures_total") == failures + 1
    assert raw_redis.get(key) is None  # deleted, so the next save can replace it
    assert await client.lookup(SCOPE, hashes, 1) == 2


async def test_a_cut_short_entry_is_a_miss(cache, client, raw_redis):
    hashes, blocks = blocks_for(SCOPE, 3, seed=6)
    await client.put(SCOPE, LAYOUT, blocks, 0, 5)
    key = record_key(cache.config.cache.key_prefix, SCOPE, hashes[1])
    raw_redis.set(key, raw_redis.get(key)[:-1000])
    before = metric(cache.telemetry.render(), "ballast_cache_misses_total", reason="partial")
    assert (await client.get(SCOPE, hashes, LAYOUT, 5)).blocks == 1
    assert metric(cache.telemetry.render(), "ballast_cache_misses_total", reason="partial") == before + 1


async def test_a_block_that_fails_its_checksum_is_not_stored(client):
    hashes, blocks = blocks_for(SCOPE, 3, seed=7)
    bad = PutBlock(1, hashes[1], blocks[1].payload, blocks[1].crc32 ^ 1)
    result = await client.put(SCOPE, LAYOUT, [blocks[0], bad, blocks[2]], 0, 5)
    assert (result.stored_blocks, result.rejected_blocks) == (2, 1)
    assert await client.lookup(SCOPE, hashes, 1) == 1


async def test_ttl_is_set_capped_and_refreshed_by_reads(cache, client, raw_redis):
    hashes, blocks = blocks_for(SCOPE, 1, seed=8)
    key = record_key(cache.config.cache.key_prefix, SCOPE, hashes[0])
    await client.put(SCOPE, LAYOUT, blocks, 30, 5)
    assert 0 < raw_redis.ttl(key) <= 30
    await client.get(SCOPE, hashes, LAYOUT, 5)
    assert raw_redis.ttl(key) > 30  # a read gives the default TTL again
    await client.put(SCOPE, LAYOUT, blocks, 10**9, 5)
    assert raw_redis.ttl(key) <= cache.config.cache.max_ttl_s


async def test_stats_and_metrics_show_a_redis_clusters_health(cache, client, backend):
    _url, cluster = backend
    if not cluster:
        assert not (await client.stats(1)).HasField("redis_cluster")
        assert "ballast_cache_redis_cluster_ok" not in cache.telemetry.render()
        return
    # The Redis probe reads the cluster's health every second.
    assert await wait_for(lambda: _positive_stat(client))
    health = (await client.stats(1)).redis_cluster
    assert (health.state_ok, health.slots_ok, health.masters, health.masters_reachable) == (True, 16384, 3, 3)
    text = cache.telemetry.render()
    assert metric(text, "ballast_cache_redis_cluster_ok") == 1
    assert metric(text, "ballast_cache_redis_cluster_masters", state="reachable") == 3


async def _positive_stat(client) -> bool:
    return (await client.stats(1)).redis_cluster.masters > 0


def put_stream(*messages):
    async def gen():
        for m in messages:
            yield m

    return gen()


async def test_bad_input_is_invalid_argument_and_stores_nothing(cache, client):
    hashes, blocks = blocks_for(SCOPE, 2, seed=9)
    open_ = kvcache_pb2.KVPutOpen(scope=SCOPE.to_pb())
    header = kvcache_pb2.KVBlockHeader(
        block_hash=hashes[0], block_index=0, layout=LAYOUT.to_pb(), size=LAYOUT.block_bytes, crc32=blocks[0].crc32
    )
    half = blocks[0].payload[:CHUNK]
    bad_streams = [
        [],  # empty
        [kvcache_pb2.KVPutRequest(headers=[header], data=blocks[0].payload)],  # no open
        [kvcache_pb2.KVPutRequest(open=open_, data=half)],  # data before any header
        [kvcache_pb2.KVPutRequest(open=open_, headers=[header], data=half)],  # ends inside a block
        [kvcache_pb2.KVPutRequest(open=open_, headers=[header], data=blocks[0].payload + b"x")],  # overruns
        [kvcache_pb2.KVPutRequest(open=open_), kvcache_pb2.KVPutRequest(open=open_)],
        [kvcache_pb2.KVPutRequest(open=kvcache_pb2.KVPutOpen(scope=kvcache_pb2.KVScope(model_version="bad version")))],
        [
            kvcache_pb2.KVPutRequest(
                open=open_, headers=[kvcache_pb2.KVBlockHeader(block_hash=hashes[0], layout=LAYOUT.to_pb(), size=7)]
            )
        ],  # size does not match the layout
    ]
    async with grpc.aio.insecure_channel(cache.address, options=CHANNEL_OPTIONS) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        for messages in bad_streams:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Put(put_stream(*messages), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, messages
        for bad_lookup in (
            kvcache_pb2.KVLookupRequest(scope=SCOPE.to_pb(), block_hashes=[b"short"]),
            kvcache_pb2.KVLookupRequest(scope=kvcache_pb2.KVScope(model_version="")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(bad_lookup, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            bad_layout = KVLayout("int4", (1, 16), 1, 16)
            async for _ in stub.Get(
                kvcache_pb2.KVGetRequest(scope=SCOPE.to_pb(), block_hashes=hashes, layout=bad_layout.to_pb()), timeout=5
            ):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await client.lookup(SCOPE, hashes, 1) == 0
    with pytest.raises(InvalidArgument):
        await client.lookup(SCOPE, [b"x"], 1)


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="ballast.v1.KVCache"), timeout=2
        )
    return reply.status


async def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.1)
    return False


async def test_redis_loss_is_unavailable_not_a_crash_and_recovers(tmp_path):
    redis = RedisServer(tmp_path).start()
    app = await create_server(make_config(redis.url, "loss:"))
    client = KVCacheClient(app.address, chunk_bytes=CHUNK)
    # A health Watch (what workers follow) hears each change as it happens, and ends with the service.
    watched: list[bool] = []

    async def follow() -> None:
        async for serving in client.watch_health():
            watched.append(serving)

    follower = asyncio.create_task(follow())
    try:
        hashes, blocks = blocks_for(SCOPE, 2, seed=10)
        await client.put(SCOPE, LAYOUT, blocks, 0, 5)
        await asyncio.to_thread(redis.stop)
        for call in (lambda: client.lookup(SCOPE, hashes, 2), lambda: client.put(SCOPE, LAYOUT, blocks, 0, 2)):
            with pytest.raises(Unavailable):
                await call()
        fetched = await client.get(SCOPE, hashes, LAYOUT, 2)
        assert fetched.blocks == 0 and isinstance(fetched.error, Unavailable)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert await wait_for(lambda: _is(health_status(app.address), health_pb2.HealthCheckResponse.NOT_SERVING))
        assert metric(app.telemetry.render(), "ballast_dependency_up", dependency="redis") == 0
        await asyncio.to_thread(redis.restart)
        assert await wait_for(lambda: _is(health_status(app.address), serving))
        # Memory-only Redis came back empty: a miss, then a fresh save works.
        assert await client.lookup(SCOPE, hashes, 2) == 0
        assert (await client.put(SCOPE, LAYOUT, blocks, 0, 5)).stored_blocks == 2
        assert (await client.get(SCOPE, hashes, LAYOUT, 5)).blocks == 2
        assert await wait_for(lambda: _now(watched == [True, False, True])), watched
        await app.shutdown(grace_s=1.0)
        await asyncio.wait_for(follower, 10)
        assert watched[:3] == [True, False, True] and set(watched[3:]) <= {False}
    finally:
        follower.cancel()
        await client.close()
        await app.shutdown(grace_s=1.0)
        redis.stop()


async def _now(value):
    return value


async def _is(awaitable, expected) -> bool:
    return await awaitable == expected


async def test_eviction_under_the_memory_bound_never_serves_a_broken_prefix(tmp_path):
    probe = RedisServer(tmp_path / "probe").start()
    try:
        baseline = int(redis_sync.Redis.from_url(probe.url).info("memory")["used_memory"])
    finally:
        probe.stop()
    bound = baseline + 600 * 1024  # room for about 60 blocks of 8 KiB (plus overhead)
    redis = RedisServer(tmp_path / "bounded", maxmemory=bound).start()
    app = await create_server(make_config(redis.url, "evict:"))
    client = KVCacheClient(app.address, chunk_bytes=CHUNK)
    try:
        sessions = [
            blocks_for(KVScope("modelv1", f"tenant{i}"), 20, seed=20 + i) + (KVScope("modelv1", f"tenant{i}"),)
            for i in range(8)
        ]
        for hashes, blocks, scope in sessions:  # 160 blocks: well over the bound
            await client.put(scope, LAYOUT, blocks, 0, 5)
        full = partial = 0
        for hashes, blocks, scope in sessions:
            fetched = await client.get(scope, hashes, LAYOUT, 5)
            assert fetched.verified_prefix() == fetched.blocks
            assert all(bytes(fetched.payload(i)) == blocks[i].payload for i in range(fetched.blocks))
            full += fetched.blocks == 20
            partial += fetched.blocks < 20
        assert partial > 0, "nothing was evicted"
        stats = await client.stats(2)
        assert stats.evicted_keys > 0 and stats.max_memory_bytes == bound
        assert await wait_for(
            lambda: _positive(lambda: metric(app.telemetry.render(), "ballast_cache_evictions_total"))
        )
    finally:
        await client.close()
        await app.shutdown(grace_s=1.0)
        redis.stop()


async def _positive(read) -> bool:
    return read() > 0
