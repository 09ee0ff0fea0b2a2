"""Session KV through real workers, the cache service and Redis: a session's next turn on a
fresh worker restores its prefix and produces exactly the tokens a full recompute does;
corrupt bytes, other tenants, other model versions, Redis or cache loss and eviction under
the memory bound all end in recomputing, never in wrong output or a broken stream."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid

import grpc
import pytest
import pytest_asyncio
import redis as redis_sync
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ballast.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.cache.app import create_server as create_cache
from services.cache.blocks import chain_hashes
from services.cache.records import record_key
from services.cache.types import KVScope
from services.common.grpc_server import CHANNEL_OPTIONS
from services.cli.localservers import RedisServer
from services.config import load_config
from services.worker.app import create_server as create_worker
from services.worker.tiny_model import render_chat

BLOCK = 16
TURN = "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def worker_config(etcd, model_dir, prefix: str, cache_address: str = "", **extra: str):
    environ = {
        "BALLAST__ETCD__HOST": etcd.host,
        "BALLAST__ETCD__PORT": str(etcd.port),
        "BALLAST__ETCD__PREFIX": prefix,
        "BALLAST__WORKER__PORT": "0",
        "BALLAST__WORKER__MODEL_DIR": str(model_dir),
        "BALLAST__WORKER__MAX_CONCURRENCY": "2",
        "BALLAST__WORKER__CACHE_ADDRESS": cache_address,
        "BALLAST__WORKER__KV_BLOCK_TOKENS": str(BLOCK),
        # No in-memory reuse: every restore in these tests comes from the cache service.
        "BALLAST__WORKER__KV_MEMORY_SESSIONS": "0",
        "BALLAST__WORKER__KV_RESTORE_POLICY": "always",
        "BALLAST__TELEMETRY__METRICS_PORT": "0",
        **extra,
    }
    return load_config(environ=environ)


def cache_config(redis_url: str, key_prefix: str, port: int = 0):
    return load_config(
        environ={
            "BALLAST__REDIS__URL": redis_url,
            "BALLAST__REDIS__TIMEOUT_S": "0.5",
            "BALLAST__CACHE__PORT": str(port),
            "BALLAST__CACHE__KEY_PREFIX": key_prefix,
            "BALLAST__TELEMETRY__METRICS_PORT": "0",
        }
    )


def metric(app, name: str, **labels) -> float:
    total = 0.0
    for line in app.telemetry.render().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def generate(
    app, prompt_ids: list[int], session: str = "", tenant: str = "acme", max_tokens: int = 24, on_token=None
) -> list[int]:
    request = worker_pb2.WorkerGenerateRequest(
        request_id=uuid.uuid4().hex,
        tenant=tenant,
        session_id=session,
        prompt_ids=prompt_ids,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(app.address, options=CHANNEL_OPTIONS) as channel:
        async for event in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=60):
            if event.HasField("tokens"):
                tokens += event.tokens.token_ids
                if on_token is not None:
                    await on_token(len(tokens))
            else:
                assert event.finished.reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    return tokens


def next_turn(app, prompt: list[int], answer: list[int], user: str) -> list[int]:
    return prompt + answer + app.engine.tokenize(TURN.format(user))


def first_turn(app, user: str) -> list[int]:
    return app.engine.tokenize(
        render_chat(
            [{"role": "system", "content": "You are a helpful shopping assistant."}, {"role": "user", "content": user}],
            add_generation_prompt=True,
        )
    )


async def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def etcd_prefix():
    return f"/ballast-kv-{uuid.uuid4().hex[:8]}/"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cache(redis_server):
    app = await create_cache(cache_config(redis_server.url, f"kvw-{uuid.uuid4().hex[:8]}:"))
    yield app
    await app.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def reference(etcd_server, tiny_model_dir, etcd_prefix):
    """Recomputes everything: no cache, no memory."""
    app = await create_worker(worker_config(etcd_server, tiny_model_dir, etcd_prefix))
    yield app
    await app.shutdown(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def restorer(etcd_server, tiny_model_dir, etcd_prefix, cache):
    app = await create_worker(worker_config(etcd_server, tiny_model_dir, etcd_prefix, cache.address))
    assert app.session_kv is not None and app.session_kv.available
    yield app
    await app.shutdown(grace_s=1.0)


async def test_next_turns_on_fresh_workers_restore_and_match_a_recompute(
    etcd_server, tiny_model_dir, etcd_prefix, cache, reference, restorer
):
    p1 = first_turn(restorer, "Where is my order 12345?")
    a1 = await generate(restorer, p1, session="s-multi")
    assert a1 == await generate(reference, p1)
    assert await restorer.session_kv.flush(10)
    assert metric(restorer, "ballast_worker_kv_saved_blocks_total") >= len(p1) // BLOCK

    p2 = next_turn(restorer, p1, a1, "And can I pay with Apple Pay?")
    fresh = await create_worker(worker_config(etcd_server, tiny_model_dir, etcd_prefix, cache.address))
    try:
        a2 = await generate(fresh, p2, session="s-multi")
        restored = metric(fresh, "ballast_worker_kv_prefix_tokens_total", source="cache")
        computed = metric(fresh, "ballast_worker_prefill_tokens_total")
        assert restored >= (len(p1) + len(a1) - 1) // BLOCK * BLOCK > 0
        assert computed == len(p2) - restored < len(p2)
        assert metric(fresh, "ballast_worker_kv_lookups_total", result="hit") == 1
        assert a2 == await generate(reference, p2)
        assert await fresh.session_kv.flush(10)
    finally:
        await fresh.shutdown(grace_s=1.0)

    # Turn 3 back on the first worker restores what the fresh one saved after turn 2.
    p3 = next_turn(restorer, p2, a2, "Thanks. Is the winter coat in stock?")
    before = metric(restorer, "ballast_worker_kv_prefix_tokens_total", source="cache")
    a3 = await generate(restorer, p3, session="s-multi")
    assert (
        metric(restorer, "ballast_worker_kv_prefix_tokens_total", source="cache") - before
        >= (len(p2) + len(a2) - 1) // BLOCK * BLOCK
    )
    assert a3 == await generate(reference, p3)


async def test_flipped_bytes_in_redis_are_a_miss_and_output_is_unchanged(cache, reference, restorer, redis_server):
    p1 = first_turn(restorer, "I was charged twice for the headphones.")
    a1 = await generate(restorer, p1, session="s-flip")
    assert await restorer.session_kv.flush(10)
    p2 = next_turn(restorer, p1, a1, "When will I get the money back?")
    hashes = chain_hashes(KVScope(restorer.engine.model.version, "acme"), BLOCK, p2)
    key = record_key(cache.config.cache.key_prefix, KVScope(restorer.engine.model.version, "acme"), hashes[1])
    r = redis_sync.Redis.from_url(redis_server.url)
    try:
        raw = bytearray(r.get(key))
        raw[len(raw) // 2] ^= 0x10
        r.set(key, bytes(raw))
    finally:
        r.close()
    before = metric(restorer, "ballast_worker_kv_prefix_tokens_total", source="cache")
    failures = metric(cache, "ballast_cache_checksum_failures_total")
    a2 = await generate(restorer, p2, session="s-flip")
    assert metric(restorer, "ballast_worker_kv_prefix_tokens_total", source="cache") - before == BLOCK  # block 0 only
    assert metric(cache, "ballast_cache_checksum_failures_total") == failures + 1
    assert a2 == await generate(reference, p2)


async def test_a_tenant_never_restores_another_tenants_blocks(reference, restorer):
    p1 = first_turn(restorer, "Do you have a discount on a phone case?")
    a1 = await generate(restorer, p1, session="s-tenant", tenant="acme")
    assert await restorer.session_kv.flush(10)
    p2 = next_turn(restorer, p1, a1, "Great, thanks.")
    before_cache = metric(restorer, "ballast_worker_kv_prefix_tokens_total", source="cache")
    before_miss = metric(restorer, "ballast_worker_kv_lookups_total", result="miss")
    a2 = await generate(restorer, p2, session="s-tenant", tenant="globex")
    assert metric(restorer, "ballast_worker_kv_lookups_total", result="miss") == before_miss + 1
    assert metric(restorer, "ballast_worker_kv_prefix_tokens_total", source="cache") == before_cache
    assert a2 == await generate(reference, p2)
    # The owner still restores it.
    await generate(restorer, p2, session="s-tenant", tenant="acme")
    assert metric(restorer, "ballast_worker_kv_prefix_tokens_total", source="cache") > before_cache


async def test_another_model_version_never_reads_these_blocks(
    etcd_server, tiny_model_dir, etcd_prefix, cache, restorer, tmp_path
):
    p1 = first_turn(restorer, "How do I change my delivery address?")
    a1 = await generate(restorer, p1, session="s-version")
    assert await restorer.session_kv.flush(10)
    p2 = next_turn(restorer, p1, a1, "Before it ships?")
    # Same weights, one config file changed: another model version by content hash.
    other_dir = tmp_path / "tiny-v2"
    shutil.copytree(tiny_model_dir, other_dir)
    gen = json.loads((other_dir / "generation_config.json").read_text())
    (other_dir / "generation_config.json").write_text(json.dumps({**gen, "ballast_revision": 2}))
    other = await create_worker(worker_config(etcd_server, other_dir, etcd_prefix, cache.address))
    try:
        assert other.engine.model.version != restorer.engine.model.version
        await generate(other, p2, session="s-version")
        assert metric(other, "ballast_worker_kv_lookups_total", result="miss") == 1
        assert metric(other, "ballast_worker_kv_prefix_tokens_total", source="cache") == 0
        assert metric(other, "ballast_worker_prefill_tokens_total") == len(p2)
    finally:
        await other.shutdown(grace_s=1.0)


async def kv_health(app) -> int:
    async with grpc.aio.insecure_channel(app.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service="kvcache"), timeout=2)).status


async def test_losing_redis_or_the_cache_mid_session_only_costs_recompute(
    etcd_server, tiny_model_dir, etcd_prefix, reference, tmp_path
):
    redis = RedisServer(tmp_path).start()
    cache = await create_cache(cache_config(redis.url, "loss:"))
    worker = await create_worker(worker_config(etcd_server, tiny_model_dir, etcd_prefix, cache.address))
    up = lambda: metric(worker, "ballast_dependency_up", dependency="kvcache")  # noqa: E731
    try:
        assert up() == 1
        prompt = worker.engine.tokenize("The customer paid for the winter coat with Apple Pay. " * 4)
        stopped_at: list[int] = []

        async def stop_redis_mid_stream(count: int) -> None:
            # At or past 20 tokens: a reader slower than the engine gets deltas merged, so the
            # count may step over 20 itself.
            if count >= 20 and not stopped_at:
                stopped_at.append(count)
                await asyncio.to_thread(redis.stop)

        a1 = await generate(worker, prompt, session="s-loss", max_tokens=120, on_token=stop_redis_mid_stream)
        assert stopped_at and stopped_at[0] < 120, stopped_at  # Redis went away mid-stream
        assert len(a1) == 120  # the stream never noticed
        assert a1 == await generate(reference, prompt, max_tokens=120)
        assert await wait_for(lambda: up() == 0)
        assert await kv_health(worker) == health_pb2.HealthCheckResponse.NOT_SERVING
        p2 = prompt + a1 + worker.engine.tokenize(" Then support answered.")
        computed = metric(worker, "ballast_worker_prefill_tokens_total")
        assert await generate(worker, p2, session="s-loss") == await generate(reference, p2)
        assert metric(worker, "ballast_worker_prefill_tokens_total") - computed == len(p2)  # recomputed

        await asyncio.to_thread(redis.restart)
        assert await wait_for(lambda: up() == 1)
        assert await kv_health(worker) == health_pb2.HealthCheckResponse.SERVING
        a2 = await generate(worker, p2, session="s-loss")  # saved again now
        assert await worker.session_kv.flush(10)
        p3 = p2 + a2 + worker.engine.tokenize(" Later the coat shipped.")
        before = metric(worker, "ballast_worker_kv_prefix_tokens_total", source="cache")
        assert await generate(worker, p3, session="s-loss") == await generate(reference, p3)
        assert metric(worker, "ballast_worker_kv_prefix_tokens_total", source="cache") > before

        # The cache service itself going away is the same story.
        port = cache.port
        await cache.shutdown(grace_s=0.5)
        assert await generate(worker, p3, session="s-loss") == await generate(reference, p3)
        assert await wait_for(lambda: up() == 0)
        cache = await create_cache(cache_config(redis.url, "loss:", port=port))
        assert await wait_for(lambda: up() == 1)
    finally:
        await worker.shutdown(grace_s=1.0)
        await cache.shutdown(grace_s=0.5)
        redis.stop()


async def test_sessions_evicted_under_the_memory_bound_restore_what_is_left(
    etcd_server, tiny_model_dir, etcd_prefix, reference, tmp_path
):
    probe = RedisServer(tmp_path / "probe").start()
    try:
        baseline = int(redis_sync.Redis.from_url(probe.url).info("memory")["used_memory"])
    finally:
        probe.stop()
    # Room for roughly two of the six sessions below (each about 18 blocks of 16 KiB).
    redis = RedisServer(tmp_path / "bounded", maxmemory=baseline + 700 * 1024).start()
    cache = await create_cache(cache_config(redis.url, "evict:"))
    worker = await create_worker(worker_config(etcd_server, tiny_model_dir, etcd_prefix, cache.address))
    try:
        sessions = []
        for i in range(6):
            text = f"Where is my order {10000 + i}? I paid for a blue phone case and it has not arrived. " * 3
            prompt = worker.engine.tokenize(text)
            answer = await generate(worker, prompt, session=f"s-evict-{i}", max_tokens=16)
            assert await worker.session_kv.flush(10)
            sessions.append((prompt, answer))
        restored_before = metric(worker, "ballast_worker_kv_prefix_tokens_total", source="cache")
        short = 0
        for i, (prompt, answer) in enumerate(sessions):
            p2 = prompt + answer + worker.engine.tokenize(" Please check again.")
            before = metric(worker, "ballast_worker_kv_prefix_tokens_total", source="cache")
            assert await generate(worker, p2, session=f"s-evict-{i}") == await generate(reference, p2)
            gained = metric(worker, "ballast_worker_kv_prefix_tokens_total", source="cache") - before
            short += gained < (len(prompt) + len(answer) - 1) // BLOCK * BLOCK
        assert short > 0, "nothing was evicted"
        assert metric(worker, "ballast_worker_kv_prefix_tokens_total", source="cache") >= restored_before
        assert await wait_for(lambda: metric(cache, "ballast_cache_evictions_total") > 0)
    finally:
        await worker.shutdown(grace_s=1.0)
        await cache.shutdown(grace_s=0.5)
        redis.stop()
