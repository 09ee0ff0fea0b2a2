"""Tenants cannot take what is not theirs, across the whole local mesh (every service a process;
real etcd, Redis and Kafka broker; a simulated worker): a tenant without an S grant asking for
S is capped and cannot preempt another tenant's B streams; a token quota charges a cancelled
stream and holds against a concurrent burst; open streams are bounded per tenant; a backfill
replay is charged to the tenant whose request degraded; a better answer waiting for delivery
survives KV-cache traffic of ten times Redis's memory bound and is pushed once; GetBackfill
tells an answer not ready yet from one that expired or was lost."""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib

import grpc
import pytest
import redis.asyncio as aioredis

from ballast.v1 import backfill_pb2, common_pb2
from services.cache.blocks import chain_hashes
from services.cache.client import KVCacheClient, PutBlock
from services.cache.types import KVLayout, KVScope
from services.cli.client import chat_request, collect
from services.cli.mesh import BACKFILL_API_KEY, LOCAL_API_KEY, Mesh, MeshSpec
from services.common.auth import ON_BEHALF_HEADER
from services.common.degraded.codec import Level, degraded_request_pb, kafka_key, make_ticket
from services.common.faults import REASON_KEY, RETRY_AFTER_KEY
from services.common.generation import Sampling
from services.router.requests import InferenceRequest
from tests.integration.test_backfill_delivery import hand_off, pushes
from tests.integration.test_mesh import metric_value, scrape
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

B_KEY, CLAIMER_KEY = "b-tenant-key", "claimer-key"
CANCEL_KEY, BURST_KEY, CONC_KEY, REPLAY_KEY = "q-cancel-key", "q-burst-key", "q-conc-key", "q-replay-key"
TOKENS_PER_MINUTE = 300  # 5 tokens a second: the tests take seconds, so refills stay small
CAPACITY = 4  # the one worker's slots: the B tenant's streams fill it


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    limited = {"tokens_per_minute": TOKENS_PER_MINUTE}
    overrides = {
        "router": {
            # Every competing stream waits its turn here (none refused): what differs between
            # the runs is whom the scheduler serves first, and whether it preempts.
            "scheduling": {"tiers": {"S": {"budget_s": 20.0}, "A": {"budget_s": 20.0}}},
            "quotas": {
                # One token per prompt character: an upper bound for the tiny model's tokenizer, so
                # reservations never undercount the prompts here.
                "prompt_chars_per_token": 1,
                "tenants": {
                    "q-cancel": limited,
                    "q-burst": limited,
                    "q-replay": limited,
                    "q-conc": {"max_concurrent": 2},
                },
            },
        },
        "degrade": {"delivery_timeout_s": 5},
        "backfill": {
            "session_timeout_ms": 6000,
            "heartbeat_interval_ms": 1000,
            "busy_backoff_s": 0.5,
            "busy_backoff_max_s": 2,
            "retry_backoff_s": 0.5,
            "subscribe_poll_s": 0.5,
            "delivery_timeout_s": 5,
        },
    }
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("tenancy"),
        model_dir=tiny_model_dir,
        workers=1,
        engine="sim",
        worker_capacity=CAPACITY,
        overrides=overrides,
        api_keys={
            LOCAL_API_KEY: "local",
            BACKFILL_API_KEY: "ballast-backfill",
            B_KEY: "batch",
            CLAIMER_KEY: "claimer",
            CANCEL_KEY: "q-cancel",
            BURST_KEY: "q-burst",
            CONC_KEY: "q-conc",
            REPLAY_KEY: "q-replay",
        },
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


def router_metrics_port(mesh) -> int:
    return next(s for s in mesh.services if s.name == "router").metrics_port


def refused(error: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str, float]:
    trailers = dict(error.trailing_metadata() or ())
    return error.code(), trailers.get(REASON_KEY, ""), int(trailers.get(RETRY_AFTER_KEY, "0")) / 1000


async def b_streams_beside(router, competitor_key: str, competitor_tier: str) -> tuple[int, list]:
    """The B tenant's CAPACITY streams fill the worker; once each is producing, the competitor
    sends 16 streams at `competitor_tier`. Returns the B streams' resumes (each preemption is
    one) and the competitor's results."""
    producing = [asyncio.Event() for _ in range(CAPACITY)]
    b_streams = [
        asyncio.create_task(
            collect(
                router,
                chat_request(f"batch summary {i}", max_tokens=400, tier="B", raw_prompt=True, allow_degraded=False),
                B_KEY,
                timeout=120,
                on_tokens=lambda _t, e=producing[i]: e.set(),
            )
        )
        for i in range(CAPACITY)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in producing)), 60)
    competitors = await asyncio.gather(
        *(
            collect(
                router,
                chat_request(f"urgent {i}", max_tokens=32, tier=competitor_tier, raw_prompt=True, allow_degraded=False),
                competitor_key,
                timeout=120,
            )
            for i in range(16)
        )
    )
    results = await asyncio.gather(*b_streams)
    for result in results:
        assert_served(result)
        assert len(result.token_ids) == 400
    return sum(r.finished.resumes for r in results), competitors


async def test_s_claimed_without_a_grant_is_capped_and_preempts_nothing(mesh, router):
    capped_before = metric_value(
        await scrape(router_metrics_port(mesh)),
        "ballast_router_tier_capped_total",
        asked="S",
        tier="A",
        reason="capped_by_grant",
    )
    # Baseline, same run: the claimer sends the same streams at B.
    baseline_resumes, baseline = await b_streams_beside(router, CLAIMER_KEY, "B")
    # The claimer has no grant (A and B): its S is capped to A, which never preempts.
    claimed_resumes, claimed = await b_streams_beside(router, CLAIMER_KEY, "S")
    # Control: a tenant granted S does preempt the B streams (so the check above can fail).
    granted_resumes, granted = await b_streams_beside(router, LOCAL_API_KEY, "S")
    for result in baseline + claimed + granted:
        assert_served(result)
    assert {(r.started.tier, r.started.tier_reason) for r in claimed} == {(common_pb2.TIER_A, "capped_by_grant")}
    assert {(r.started.tier, r.started.tier_reason) for r in granted} == {(common_pb2.TIER_S, "explicit")}
    # What was measured, for whoever runs this with -s.
    print(
        f"\nmeasured: B streams preempted beside 16 streams at B {baseline_resumes}, "
        f"at S claimed without a grant {claimed_resumes}, at S with a grant {granted_resumes}"
    )
    assert granted_resumes > 0, "the control tenant's S streams preempted nothing: the comparison proves nothing"
    assert claimed_resumes == baseline_resumes == 0, (claimed_resumes, baseline_resumes, granted_resumes)
    capped_after = metric_value(
        await scrape(router_metrics_port(mesh)),
        "ballast_router_tier_capped_total",
        asked="S",
        tier="A",
        reason="capped_by_grant",
    )
    assert capped_after - capped_before == 16


async def test_a_tagging_rule_cannot_lift_a_request_above_the_grant(router):
    request = chat_request("flash sale question", max_tokens=4, raw_prompt=True, allow_degraded=False)
    request.signals.business_tag = "promotion"  # the default rules make this S
    claimed = await collect(router, request, CLAIMER_KEY)
    granted = await collect(router, request, LOCAL_API_KEY)
    assert (claimed.started.tier, claimed.started.tier_reason) == (common_pb2.TIER_A, "capped_by_grant")
    assert (granted.started.tier, granted.started.tier_reason) == (common_pb2.TIER_S, "promotion")


async def test_only_the_backfills_key_may_act_for_another_tenant(router):
    call = router.Generate(
        chat_request("hi", max_tokens=4, raw_prompt=True),
        metadata=(("x-api-key", CLAIMER_KEY), (ON_BEHALF_HEADER, "local")),
        timeout=30,
    )
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _event in call:
            pass
    assert refused(error.value)[:2] == (grpc.StatusCode.PERMISSION_DENIED, "permission_denied")
    assert ON_BEHALF_HEADER in error.value.details()


async def until_settled(mesh, outcome: str, before: float) -> None:
    """Until the router has counted one more request ending with `outcome` (it settles the
    request's quota just before)."""
    for _ in range(200):
        now = metric_value(await scrape(router_metrics_port(mesh)), "ballast_router_requests_total", outcome=outcome)
        if now > before:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the router never counted a {outcome} request")


async def test_a_stream_cancelled_before_its_end_is_charged_what_it_generated(mesh, router):
    port = router_metrics_port(mesh)
    cancelled_before = metric_value(await scrape(port), "ballast_router_requests_total", outcome="cancelled")
    # Reserves 1 + 290 of the 300: admitted. The cancel comes after 150 tokens at the client,
    # 140 before the stream's end: a client that reads late on a busy machine (tokens travel in
    # batches) still cancels a stream that is running.
    call = router.Generate(
        chat_request("c", max_tokens=290, tier="A", raw_prompt=True, allow_degraded=False),
        metadata=(("x-api-key", CANCEL_KEY),),
        timeout=60,
    )
    received = 0
    async for event in call:
        received += len(event.tokens.token_ids)
        if received >= 150:
            break
    call.cancel()
    await until_settled(mesh, "cancelled", cancelled_before)
    # It was charged what it generated (at least 150), so the next 196 do not fit.
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(router, chat_request("c", max_tokens=195, tier="A", raw_prompt=True), CANCEL_KEY)
    code, reason, retry_after_s = refused(error.value)
    print(
        f"\nmeasured: a stream cancelled after {received} of 290 tokens was charged: the next request of "
        f"196 was refused ({reason}, refill in {retry_after_s:.1f} s)"
    )
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "quota_exceeded")
    assert retry_after_s > 0


async def test_a_concurrent_burst_cannot_spend_more_than_the_limit_and_one_reservation(router):
    started = time.monotonic()
    max_tokens = 100
    outcomes = await asyncio.gather(
        *(
            collect(
                router,
                chat_request(f"b{i}", max_tokens=max_tokens, tier="A", raw_prompt=True, allow_degraded=False),
                BURST_KEY,
                timeout=60,
            )
            for i in range(8)
        ),
        return_exceptions=True,
    )
    served = [o for o in outcomes if not isinstance(o, BaseException)]
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    for error in errors:
        assert isinstance(error, grpc.aio.AioRpcError), error
        assert refused(error)[:2] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "quota_exceeded")
    used = sum(r.finished.usage.prompt_tokens + r.finished.usage.completion_tokens for r in served)
    reservation = 2 + max_tokens
    refilled = (time.monotonic() - started) * TOKENS_PER_MINUTE / 60
    print(
        f"\nmeasured: 8 concurrent requests of {max_tokens} tokens against {TOKENS_PER_MINUTE} a minute: "
        f"{len(served)} served using {used} tokens, {len(errors)} refused"
    )
    assert served and errors
    assert used <= TOKENS_PER_MINUTE + reservation + refilled, (used, len(served), refilled)


async def test_a_tenants_open_streams_are_bounded(router):
    producing = [asyncio.Event(), asyncio.Event()]
    open_streams = [
        asyncio.create_task(
            collect(
                router,
                chat_request(f"long {i}", max_tokens=300, tier="A", raw_prompt=True, allow_degraded=False),
                CONC_KEY,
                timeout=60,
                on_tokens=lambda _t, e=producing[i]: e.set(),
            )
        )
        for i in range(2)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in producing)), 30)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(router, chat_request("third", max_tokens=4, tier="A", raw_prompt=True), CONC_KEY)
    assert refused(error.value)[:2] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "quota_exceeded")
    assert "streams open" in error.value.details()
    for result in await asyncio.gather(*open_streams):
        assert_served(result)
    assert_served(await collect(router, chat_request("after", max_tokens=4, tier="A", raw_prompt=True), CONC_KEY))


async def get_answer(router, ticket: str, key: str, timeout_s: float = 120.0) -> backfill_pb2.BackfilledAnswer:
    """Polls GetBackfill until the answer is stored (NOT_FOUND backfill_pending until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await router.GetBackfill(
                backfill_pb2.GetAnswerRequest(ticket=ticket), metadata=(("x-api-key", key),), timeout=5
            )
        except grpc.aio.AioRpcError as error:
            code, reason, _ = refused(error)
            if reason != "backfill_pending" and code != grpc.StatusCode.UNAVAILABLE:
                raise  # expired, lost, or anything else: it will not come
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


async def test_a_replay_is_charged_to_the_tenant_whose_request_degraded(router, handoff):
    request = InferenceRequest(
        request_id=uuid.uuid4().hex,
        session_id="",
        tenant="q-replay",
        model="tiny",
        sampling=Sampling(max_tokens=250, temperature=0.0),
        tier="A",
        prompt="r",
    )
    ticket = make_ticket("q-replay", request.request_id)
    record = degraded_request_pb(
        request,
        ticket=ticket,
        tier="A",
        level=Level.RULES,
        reason="admission",
        degraded_text="quick answer",
        degraded_by="rules",
        received_at=time.time(),
    )
    await handoff.submit(kafka_key("", ticket), record.SerializeToString())
    answer = await get_answer(router, ticket, REPLAY_KEY)
    assert answer.tenant == "q-replay" and answer.usage.completion_tokens == 250
    # The replay spent about 251 of the tenant's 300: its own request of 201 does not fit.
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(router, chat_request("r", max_tokens=200, tier="A", raw_prompt=True), REPLAY_KEY)
    code, reason, retry_after_s = refused(error.value)
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "quota_exceeded")
    assert retry_after_s > 10  # over 150 tokens short, at 5 a second


# 2 layers x 2 x 2 heads x 64 tokens x 64 dims x 4 bytes = 128 KiB a block.
LAYOUT = KVLayout("float32", (2, 2, 2, 64, 64), 2, 64)


async def kv_traffic(cache_address: str, total_bytes: int) -> int:
    """Puts KV blocks through the cache service until `total_bytes` went in; returns the bytes."""
    client = KVCacheClient(cache_address)
    sent = 0
    try:
        turn = 0
        while sent < total_bytes:
            scope = KVScope(model_version="evict-v1", tenant=f"chatty-{turn % 7}")
            tokens = [(turn * 131 + i) % 500 for i in range(16 * LAYOUT.block_tokens)]
            blocks = []
            for i, block_hash in enumerate(chain_hashes(scope, LAYOUT.block_tokens, tokens)):
                payload = bytes([(turn + i) % 251]) * LAYOUT.block_bytes
                blocks.append(PutBlock(i, block_hash, payload, zlib.crc32(payload)))
            await client.put(scope, LAYOUT, blocks, 0, timeout_s=30)
            sent += len(blocks) * LAYOUT.block_bytes
            turn += 1
    finally:
        await client.close()
    return sent


async def test_a_waiting_better_answer_survives_kv_traffic_of_ten_times_the_memory_bound(mesh, router, handoff):
    session = uuid.uuid4().hex
    ticket = await hand_off(handoff, session)
    await get_answer(router, ticket, LOCAL_API_KEY)  # stored, not yet delivered
    client = aioredis.Redis.from_url(mesh.redis.url)
    original = (await client.config_get("maxmemory"))["maxmemory"]
    try:
        assert (await client.config_get("maxmemory-policy"))["maxmemory-policy"] == "volatile-lru"
        bound = int((await client.info("memory"))["used_memory"]) + 8 * 1024 * 1024
        await client.config_set("maxmemory", bound)
        evicted_before = int((await client.info("stats"))["evicted_keys"])
        sent = await kv_traffic(f"127.0.0.1:{mesh.cache_port}", 10 * bound)
        assert sent >= 10 * bound
        # The pressure was real: Redis evicted KV blocks to stay in its bound.
        evicted = int((await client.info("stats"))["evicted_keys"]) - evicted_before
        print(
            f"\nmeasured: {sent >> 20} MiB of KV blocks through a Redis bound of {bound >> 20} MiB evicted "
            f"{evicted} keys; the waiting answer was still there"
        )
        assert evicted > 0
        assert (await get_answer(router, ticket, LOCAL_API_KEY, timeout_s=5)).ticket == ticket
        assert await pushes(router, [session], expected=1) == [ticket]  # delivered, once
    finally:
        await client.config_set("maxmemory", original)
        await client.aclose()


async def test_get_backfill_tells_an_expired_or_lost_answer_from_one_not_ready(mesh, router, handoff):
    ticket = await hand_off(handoff, uuid.uuid4().hex)
    await get_answer(router, ticket, LOCAL_API_KEY)
    client = aioredis.Redis.from_url(mesh.redis.url)
    prefix = "ballast:backfill:"
    try:
        # What a store that lost data leaves: the ticket's state says stored, the answer is gone.
        await client.delete(f"{prefix}answer:{ticket}")
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await get_answer(router, ticket, LOCAL_API_KEY, timeout_s=0)
        assert refused(lost.value)[:2] == (grpc.StatusCode.DATA_LOSS, "backfill_lost")
        # What the retention sweep leaves behind it.
        await client.set(f"{prefix}state:{ticket}", "expired\0local")
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await get_answer(router, ticket, LOCAL_API_KEY, timeout_s=0)
        assert refused(expired.value)[:2] == (grpc.StatusCode.NOT_FOUND, "backfill_expired")
    finally:
        await client.aclose()
    with pytest.raises(grpc.aio.AioRpcError) as pending:
        await get_answer(router, make_ticket("local", uuid.uuid4().hex), LOCAL_API_KEY, timeout_s=0)
    assert refused(pending.value)[:2] == (grpc.StatusCode.NOT_FOUND, "backfill_pending")
